"""Process snapshots with real CRIU: baked once, restored by faas-bootstrap, served through the real server
and the real OpenAI client; and the fallbacks when the snapshot does not fit or is damaged."""

from __future__ import annotations

import json
import time
from pathlib import Path

import httpx
import xxhash
import openai
import pytest

from runtime.config import Settings
from snapshots.checkpoint import SnapshotError
from snapshots.criu import find_criu
from snapshots.handoff import CLAIM_CHECK_S
from snapshots.image import IMAGES, MANIFEST, SnapshotImage
from snapshots.process import bake_process_snapshot
from tests.helpers import children_of, processes_running
from tests.server.conftest import API_KEY, start_server
from tests.snapshots.conftest import BAKE_ONLY, ENGINE_ENV

pytestmark = pytest.mark.criu

PROMPT = "The snapshot restores"


def greedy_text(server) -> str:
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key=API_KEY, max_retries=0, timeout=60)
    r = client.completions.create(model="tiny-llama", prompt=PROMPT, max_tokens=24, temperature=0.0,
                                  extra_body={"ignore_eos": True})
    return r.choices[0].text


def health(server) -> dict:
    return httpx.get(f"{server.url}/health", timeout=5).json()


@pytest.fixture(scope="module")
def cold_text(tiny_model_dir, tmp_path_factory) -> str:
    server = start_server(tmp_path_factory.mktemp("cold"), "cold", MODEL=str(tiny_model_dir), API_KEY=API_KEY,
                          **ENGINE_ENV)
    try:
        server.wait_ready()
        return greedy_text(server)
    finally:
        server.stop()


def boot(tmp_path: Path, model: Path, snapshot_dir: Path, **env: str):
    server = start_server(tmp_path, "boot", MODEL=str(model), SNAPSHOT_DIR=str(snapshot_dir), API_KEY=API_KEY,
                          **(ENGINE_ENV | env))
    server.wait_ready()
    return server


def test_bake_writes_a_checked_image_with_its_fingerprint(process_snapshot, tiny_model_dir):
    image = SnapshotImage.read(process_snapshot / "process")
    assert image.kind == "process" and image.verify_restore_s > 0 and image.dump_s > 0
    assert image.fingerprint.torch and image.fingerprint.criu.startswith("4.")
    assert json.loads(image.fingerprint.engine_config)["max_model_len"] == 2048
    assert image.size_bytes > 10_000_000  # torch and the engine are in it
    pages = max(image.files, key=image.files.get)
    assert pages.startswith("pages-") and set(image.digests) == set(image.files)
    # the digest of a page image is xxh3-128 over its 32 MiB parts' xxh3-128 digests (hashed in parallel)
    data, part = (process_snapshot / "process" / IMAGES / pages).read_bytes(), 32 << 20
    assert len(data) > part  # several parts
    parts = b"".join(xxhash.xxh3_128(data[i:i + part]).digest() for i in range(0, len(data), part))
    assert image.hash == "xxh3-128-parts" and image.digests[pages] == xxhash.xxh3_128(parts).hexdigest()
    assert [p.name for p in process_snapshot.iterdir()] == ["process"]  # no temporary left beside it


@pytest.mark.parametrize("pid_namespace", [True, False])
def test_a_failed_dump_leaves_no_frozen_runtime(tiny_model_dir, tmp_path, monkeypatch, pid_namespace):
    """criu can fail to dump the runtime the bake froze. Left running, that process would wait for a handoff
    forever (in a pid namespace of its own), or the bake would wait for it forever (without one)."""
    criu = tmp_path / "criu"  # its dumps fail; the rest is the real criu
    criu.write_text(f'#!/bin/sh\nif [ "$1" = dump ]; then echo "Error (criu): no dump here" >&2; exit 1; fi\n'
                    f'exec {find_criu().path} "$@"\n')
    criu.chmod(0o755)
    monkeypatch.setenv("THAWLLM_CRIU", str(criu))
    before = set(processes_running(b"snapshots.frozen"))
    settings = Settings.from_env({"MODEL": str(tiny_model_dir), **ENGINE_ENV, **BAKE_ONLY})
    with pytest.raises(SnapshotError, match="no dump here"):
        bake_process_snapshot(settings, tiny_model_dir, tmp_path / "snapshots", pid_namespace=pid_namespace)
    deadline = time.monotonic() + 2 * CLAIM_CHECK_S + 2
    while set(processes_running(b"snapshots.frozen")) - before:
        assert time.monotonic() < deadline, "the frozen runtime is still running"
        time.sleep(0.05)
    assert not (tmp_path / "snapshots" / "process").exists()


def test_restored_runtime_serves_like_a_cold_start(process_snapshot, tiny_model_dir, cold_text, tmp_path):
    server = boot(tmp_path, tiny_model_dir, process_snapshot)
    try:
        state = health(server)
        assert state["restore_path"] == "process"
        assert state["skipped"] == {"gpu": f"no snapshot at {process_snapshot / 'gpu'}"}
        assert "restore" in state["timeline"] and 0 < state["timeline"]["restore"] < 5
        verify = next(s for s in state["stages"] if s["stage"] == "snapshot_verify")  # its own stage
        assert verify["detail"]["snapshot"] == "process" and verify["detail"]["bytes"] > 10_000_000
        restore = next(s for s in state["stages"] if s["stage"] == "restore")
        assert verify["start_s"] < restore["end_s"]  # beside the restore, not after it
        # the bootstrap, now supervising its restored child, never loaded torch on the way (seconds)
        maps = Path(f"/proc/{server.process.pid}/maps").read_text()
        assert "libtorch" not in maps and "libc10" not in maps
        assert greedy_text(server) == cold_text
        # PORT and API_KEY are the ones it was restored with, not the baked ones
        baked_key = httpx.get(f"{server.url}/v1/models", timeout=5,
                              headers={"Authorization": f"Bearer {BAKE_ONLY['API_KEY']}"})
        assert baked_key.status_code == 401
        log = server.log()
        assert "process snapshot: CRIU restored pid" in log and "restore path process" in log  # on the new stderr
    finally:
        assert server.stop() == 0  # SIGTERM forwarded to the restored runtime, which drained and exited 0


def test_timeline_is_measured_from_the_new_spawn(process_snapshot, tiny_model_dir, tmp_path):
    server = boot(tmp_path, tiny_model_dir, process_snapshot)
    try:
        table = server.log().split("cold-start timeline (seconds since spawn)")[1]
        restore_row = next(line for line in table.splitlines() if line.strip().startswith("restore"))
        start = float(restore_row.split()[1])
        assert 0 <= start < 10  # seconds after the bootstrap's spawn, not after the bake
        # the restore stage says where its time went: criu (started by the entry point, early_s before the
        # bootstrap's checks reached it), then the bootstrap's second run in the restored process, which ends
        # where the engine's device phase begins
        stages = {s["stage"]: s for s in health(server)["stages"]}
        restore = stages["restore"]
        parts = restore["detail"]
        assert 0 <= parts["early_s"] and 0 < parts["criu_s"] <= restore["seconds"]
        assert 0 < parts["bootstrap_s"] <= stages["cuda_init"]["start_s"] - restore["end_s"] + 0.001
        # and what came between the device and the KV cache, within that gap: how late the engine's start came
        # after the device, its way from there to the runner, and the weight buffer
        kv = stages["kv_cache"]
        parts = [kv["detail"][k] for k in ("called_after_device_s", "device_to_runner_s", "weight_buffer_s")]
        assert min(parts) >= 0 and sum(parts) <= kv["start_s"] - stages["cuda_init"]["end_s"] + 0.002
    finally:
        server.stop()


def test_fingerprint_mismatch_falls_back_to_cold(snapshot_copy, tiny_model_dir, cold_text, tmp_path):
    manifest = snapshot_copy / "process" / MANIFEST
    data = json.loads(manifest.read_text())
    data["fingerprint"]["torch"] = "0.0.1"
    manifest.write_text(json.dumps(data))
    server = boot(tmp_path, tiny_model_dir, snapshot_copy)
    try:
        state = health(server)
        assert state["restore_path"] == "cold"
        assert state["skipped"]["process"].startswith("fingerprint mismatch: torch baked '0.0.1'")
        assert "restore path process skipped: fingerprint mismatch: torch" in server.log()
        assert greedy_text(server) == cold_text
    finally:
        server.stop()


def test_changed_engine_settings_do_not_restore(process_snapshot, tiny_model_dir, tmp_path):
    server = boot(tmp_path, tiny_model_dir, process_snapshot, MAX_NUM_SEQS="8")
    try:
        assert health(server)["skipped"]["process"].startswith("fingerprint mismatch: engine_config")
        # the entry point had started restoring it before the settings were checked: undone, nothing left
        assert children_of(server.process.pid) == []
    finally:
        server.stop()


def test_corrupted_image_falls_back_to_cold_leaving_nothing_behind(snapshot_copy, tiny_model_dir, cold_text,
                                                                   tmp_path):
    for core in (snapshot_copy / "process" / IMAGES).glob("core-*.img"):
        core.write_bytes(bytes(range(256)) * (core.stat().st_size // 256) + b"\0" * (core.stat().st_size % 256))
    server = boot(tmp_path, tiny_model_dir, snapshot_copy)
    try:
        state = health(server)
        assert state["restore_path"] == "cold"
        # CRIU fails on the damaged image; the reason given is the damage, found by the digests meanwhile
        assert state["skipped"]["process"].startswith("process snapshot image file core-")
        assert "does not match its xxh3-128-parts digest" in state["skipped"]["process"]
        assert "restore path process refused, starting fresh" in server.log()
        assert children_of(server.process.pid) == []  # no restored process left running
        assert greedy_text(server) == cold_text
    finally:
        server.stop()


def test_a_same_size_edit_of_a_page_image_is_refused_and_falls_back(snapshot_copy, tiny_model_dir, cold_text,
                                                                   tmp_path):
    """Sizes match, CRIU would restore it: only the digests tell. Nothing of the edited image is served."""
    pages = max((snapshot_copy / "process" / IMAGES).glob("pages-*.img"), key=lambda p: p.stat().st_size)
    with open(pages, "r+b") as f:
        f.seek(pages.stat().st_size // 2)
        chunk = f.read(64)
        f.seek(-64, 1)
        f.write(bytes(b ^ 0x20 for b in chunk))
    server = boot(tmp_path, tiny_model_dir, snapshot_copy)
    try:
        state = health(server)
        assert state["restore_path"] == "cold"
        assert state["skipped"]["process"] == (
            f"process snapshot image file {pages.name} does not match its xxh3-128-parts digest from the bake: the "
            "snapshot was changed after it was baked")
        assert f"restore path process refused, starting fresh: process snapshot image file {pages.name}" in (
            server.log())
        assert children_of(server.process.pid) == []  # the restored process was killed before its hand-over
        assert greedy_text(server) == cold_text
    finally:
        server.stop()


def test_an_image_without_digests_is_not_restored(snapshot_copy, tiny_model_dir, tmp_path):
    manifest = snapshot_copy / "process" / MANIFEST
    data = json.loads(manifest.read_text())
    data.pop("digests"), data.pop("hash")
    manifest.write_text(json.dumps(data))
    server = boot(tmp_path, tiny_model_dir, snapshot_copy)
    try:
        assert health(server)["skipped"]["process"].startswith("the snapshot has no digests of its image files")
    finally:
        server.stop()


def test_an_image_with_whole_file_digests_is_checked_with_those(snapshot_copy, tiny_model_dir, cold_text,
                                                               tmp_path):
    """Snapshots baked before the digests were taken over parts are still checked, and restored."""
    manifest = snapshot_copy / "process" / MANIFEST
    data = json.loads(manifest.read_text())
    images = snapshot_copy / "process" / IMAGES
    data["hash"] = "xxh3-128"
    data["digests"] = {name: xxhash.xxh3_128((images / name).read_bytes()).hexdigest() for name in data["digests"]}
    manifest.write_text(json.dumps(data))
    server = boot(tmp_path, tiny_model_dir, snapshot_copy)
    try:
        assert health(server)["restore_path"] == "process"
        assert greedy_text(server) == cold_text
    finally:
        server.stop()
    pages = max(images.glob("pages-*.img"), key=lambda p: p.stat().st_size)
    with open(pages, "r+b") as f:
        f.write(b"\xff" * 16)
    (tmp_path / "edited").mkdir()
    server = boot(tmp_path / "edited", tiny_model_dir, snapshot_copy)
    try:
        assert health(server)["skipped"]["process"].startswith(
            f"process snapshot image file {pages.name} does not match its xxh3-128 digest")
    finally:
        server.stop()


def test_truncated_image_is_caught_before_criu_runs(snapshot_copy, tiny_model_dir, tmp_path):
    pages = max((snapshot_copy / "process" / IMAGES).glob("pages-*.img"), key=lambda p: p.stat().st_size)
    with open(pages, "r+b") as f:
        f.truncate(pages.stat().st_size // 2)
    server = boot(tmp_path, tiny_model_dir, snapshot_copy)
    try:
        assert health(server)["skipped"]["process"] == (
            f"image file {pages.name} is {pages.stat().st_size} bytes, baked {pages.stat().st_size * 2}")
    finally:
        server.stop()


def test_snapshot_without_pid_namespace_restores_with_its_own_pids(tiny_model_dir, cold_text, tmp_path):
    from runtime.config import Settings
    from snapshots.process import bake_process_snapshot

    settings = Settings.from_env({"MODEL": str(tiny_model_dir), **ENGINE_ENV})
    image = bake_process_snapshot(settings, tiny_model_dir, tmp_path / "snapshots", pid_namespace=False)
    assert image.pid_namespace is False
    server = boot(tmp_path, tiny_model_dir, tmp_path / "snapshots")
    try:
        assert health(server)["restore_path"] == "process"
        runtime_pid = children_of(server.process.pid)[0]
        assert Path(f"/proc/{runtime_pid}/status").read_text().count("NSpid:\t%d\n" % runtime_pid) == 1
        assert greedy_text(server) == cold_text
    finally:
        assert server.stop() == 0



@pytest.fixture
def plain_snapshots(tiny_model_dir, tmp_path) -> list[Path]:
    """Two process snapshots baked without a pid namespace (as on a GPU: restored with their baked pids)."""
    from runtime.config import Settings
    from snapshots.process import bake_process_snapshot

    settings = Settings.from_env({"MODEL": str(tiny_model_dir), **ENGINE_ENV})
    dirs = [tmp_path / f"snapshots-{k}" for k in range(2)]
    for directory in dirs:
        bake_process_snapshot(settings, tiny_model_dir, directory, pid_namespace=False)
    return dirs


def test_an_instance_in_a_pid_namespace_of_its_own_restores_while_another_holds_the_baked_pids(
        plain_snapshots, tiny_model_dir, cold_text, tmp_path):
    """The trace bench's --pid-namespaces: an instance started as a container's process finds the baked pids
    free; started beside the first without one, it finds them taken and starts cold instead."""
    import asyncio

    from runtime.bench.instance import Instance

    env = {"MODEL": str(tiny_model_dir), "SNAPSHOT_DIR": str(plain_snapshots[0]), "API_KEY": API_KEY, **ENGINE_ENV}

    async def second_beside_first(own_pid_namespace: bool) -> list[dict]:
        instances: list[Instance] = []
        try:
            async with httpx.AsyncClient() as client:
                for k in range(2):  # the second while the first serves, after the first's handoff
                    instances.append(Instance.spawn("process", env, tmp_path / f"{own_pid_namespace}-{k}.log",
                                                    own_pid_namespace))
                    await instances[-1].wait_ready(client, 120)
            return [i.health | {"text": greedy_text(i)} for i in instances]
        finally:
            assert await asyncio.gather(*(i.stop() for i in instances)) == [0] * len(instances)

    isolated = asyncio.run(second_beside_first(own_pid_namespace=True))
    assert [h["restore_path"] for h in isolated] == ["process", "process"]
    assert [h["text"] for h in isolated] == [cold_text, cold_text]
    shared = asyncio.run(second_beside_first(own_pid_namespace=False))
    assert [h["restore_path"] for h in shared] == ["process", "cold"]
    assert "criu restore exited 1: Can't fork for " in shared[1]["skipped"]["process"]  # the reason, in one line
    assert [h["text"] for h in shared] == [cold_text, cold_text]


def test_a_trace_restores_every_instance_running_at_once_from_a_snapshot_of_its_own(plain_snapshots, tiny_model_dir,
                                                                                     tmp_path):
    """--instance-snapshot-dirs: each instance of the scaled-out pool takes a snapshot no running instance holds,
    so plain snapshots restore side by side on one host (one snapshot twice would clash over its baked pids)."""
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-m", "runtime.bench.cli", "trace", "--model", str(tiny_model_dir),
                           "--device", "cpu", "--modes", "process", "--rates", "12", "--duration", "3",
                           "--length-scale", "0.05", "--max-instances", "2", "--slots", "1", "--queue-threshold", "1",
                           "--instance-snapshot-dirs", ",".join(map(str, plain_snapshots)),
                           *[f"--set={k}={v}" for k, v in ENGINE_ENV.items() if k != "DEVICE"],
                           "--out", str(tmp_path / "trace")], capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    (point,) = json.loads((tmp_path / "trace" / "trace.json").read_text())["points"]
    assert point["status"] == "ok" and point["completed"] == point["requests"] > 0, point
    assert len(point["instances"]) == 2  # twelve requests a second with one slot each: the pool scaled out
    assert [i["restore_path"] for i in point["instances"]] == ["process", "process"]
