"""faas-build end to end on a CPU machine with real CRIU: one command writes the layout, bakes every
snapshot this machine can bake (process here; materialized and gpu skipped with a reason) and times a real
start from each; a faas-bootstrap pointed at what it wrote restores the process snapshot, serves the layout's
model and reports the measured order."""

from __future__ import annotations

import json
import subprocess
import sys

import httpx
import pytest

from runtime.weights import prefetch
from snapshots.start_pages import LIST_FILE, read_list
from tests.server.conftest import API_KEY, REPO, server_env, start_server
from tests.snapshots.conftest import ENGINE_ENV
from tests.snapshots.test_process_snapshot import greedy_text
from tests.test_weights_prefetch import drop_from_page_cache

pytestmark = pytest.mark.criu


def faas_build(*args: str, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "snapshots.build", *args], cwd=REPO, env=server_env(**env),
                          capture_output=True, text=True, timeout=300)


def test_faas_build_bakes_what_this_machine_can_and_the_function_boots_from_it(tiny_model_dir, tmp_path):
    out, snapshots = tmp_path / "baked" / "model", tmp_path / "baked" / "snapshots"
    r = faas_build("--model", str(tiny_model_dir), "--out", str(out), "--snapshot-dir", str(snapshots),
                   "--dtype", "float32", "--quiet", "--time-restores", "2", **ENGINE_ENV)
    assert r.returncode == 0, r.stderr
    summary = r.stderr[r.stderr.index("snapshots:"):]
    assert "process       baked" in summary
    assert "materialized  skipped" in summary and "needs a GPU" in summary
    assert (out / "manifest.json").is_file() and (snapshots / "process" / "manifest.json").is_file()
    assert not (snapshots / "materialized").exists() and not (snapshots / "gpu").exists()
    # two real starts from the process snapshot, timed spawn -> first token; the only path it could bake
    measured = json.loads((snapshots / "restore-order.json").read_text())
    assert measured["order"] == ["process"] and measured["rounds"] == 2
    runs = measured["paths"]["process"]["runs_s"]
    assert len(runs) == 2 and all(0 < s < 120 for s in runs)
    assert "restore order process, gpu, materialized (measured by faas-build" in summary
    # a start from the process snapshot served two requests; the file pages it touched are listed beside it
    listed = read_list(snapshots / "process" / LIST_FILE)
    torch_cpu = next(f for f in listed if f.path.endswith("libtorch_cpu.so"))
    assert 0 < torch_cpu.bytes < torch_cpu.size / 2
    assert not any(f.path.startswith(str(out)) for f in listed)  # the weights: their own prefetch reads them
    total = sum(f.bytes for f in listed) / (1 << 20)
    assert f"process start pages: {total:.1f} MiB of {len(listed)} files" in summary

    cold = start_server(tmp_path, "cold", MODEL=str(tiny_model_dir), API_KEY=API_KEY, **ENGINE_ENV)
    try:
        cold.wait_ready()
        expected = greedy_text(cold)
    finally:
        cold.stop()
    server = start_server(tmp_path, "baked", MODEL=str(out), SNAPSHOT_DIR=str(snapshots), API_KEY=API_KEY,
                          SERVED_MODEL_NAME="tiny-llama", **ENGINE_ENV)
    try:
        server.wait_ready()
        health = health_of(server)
        assert health["restore_path"] == "process"
        assert health["restore_order"]["source"] == "measured" and health["restore_order"]["fastest"] == "process"
        assert health["restore_order"]["seconds"] == {"process": measured["paths"]["process"]["median_s"]}
        assert greedy_text(server) == expected
    finally:
        assert server.stop() == 0
    assert "restore order process, gpu, materialized (measured by faas-build" in server.log()

    # the weights not in the page cache: the entry point prefetches them beside CRIU, on fewer threads until the
    # restore has handed over
    drop_from_page_cache([path for path, _ in prefetch.layout_files(str(out))])
    server = start_server(tmp_path, "dropped", MODEL=str(out), SNAPSHOT_DIR=str(snapshots), API_KEY=API_KEY,
                          SERVED_MODEL_NAME="tiny-llama", PREFETCH_READERS="6", PREFETCH_RESTORE_READERS="2",
                          **ENGINE_ENV)
    try:
        server.wait_ready()
        assert health_of(server)["restore_path"] == "process" and greedy_text(server) == expected
    finally:
        assert server.stop() == 0
    assert "weights prefetch: reading 0.00 GiB into the page cache with 2 threads, 6 once widened" in server.log()


def test_a_snapshot_kind_asked_for_by_name_that_cannot_be_baked_fails_the_build(tiny_model_dir, tmp_path):
    r = faas_build("--model", str(tiny_model_dir), "--out", str(tmp_path / "model"), "--snapshot-dir",
                   str(tmp_path / "snapshots"), "--snapshots", "gpu", "--quiet", **ENGINE_ENV)
    assert r.returncode == 1
    last_line = r.stderr.strip().splitlines()[-1]
    assert last_line == "faas-build: snapshots not baked: gpu (see above); the others are in place"
    assert "needs a GPU" in r.stderr
    assert not (tmp_path / "snapshots" / "gpu").exists()


def health_of(server) -> dict:
    return httpx.get(f"{server.url}/health", timeout=5).json()
