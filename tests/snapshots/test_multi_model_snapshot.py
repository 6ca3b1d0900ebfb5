"""The process snapshot of a several-model instance, with real CRIU: faas-build bakes one image holding every
model's engine on each simulated device (POOL_CPU_DEVICES=2), faas-bootstrap restores it and pools the
engines, and each model answers exactly as transformers does with that model alone; a damaged image, a model
changed after the bake or another device set falls back to the fresh start with the reason in /health."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from snapshots.image import IMAGES, SnapshotImage
from tests.helpers import children_of
from tests.server.test_multi_model import MAX_TOKENS, PROMPTS, complete, faas_build, http_get, served_text, start

pytestmark = pytest.mark.criu

SOURCES = {"a": "tiny-llama", "b": "tiny-qwen2"}
#: what the instance is baked and booted with beside the engine settings faas_build and start give it
#: (POOL_MEMORY_GB is read at boot: not in the image)
INSTANCE = {"POOL_CPU_DEVICES": "2"}


@pytest.fixture(scope="module")
def sources(tiny_model) -> dict[str, str]:
    return {name: tiny_model(preset) for name, preset in SOURCES.items()}


@pytest.fixture(scope="module")
def expected(sources) -> dict[tuple[str, int], str]:
    return {(name, i): served_text(sources[name], prompt, MAX_TOKENS)
            for name in SOURCES for i, prompt in enumerate(PROMPTS)}


@pytest.fixture(scope="module")
def baked(sources, tmp_path_factory) -> tuple[Path, Path]:
    """(the layouts' directory, the snapshot directory) of one faas-build of both models."""
    root = tmp_path_factory.mktemp("baked")
    out, snapshots = root / "models", root / "snapshots"
    listed = ",".join(f"{name}={path}" for name, path in sources.items())
    r = faas_build("--model", listed, "--out", str(out), "--snapshot-dir", str(snapshots), "--dtype", "float32",
                   "--chunk-mb", "0.125", "--quiet", **INSTANCE)
    assert r.returncode == 0, r.stderr
    instance = r.stderr[r.stderr.index("the instance (every model's engine):"):]
    assert "process       baked" in instance and "a: cpu:0, cpu:1; b: cpu:0, cpu:1" in instance
    assert "gpu           skipped" in instance and "has no gpu snapshot: its image would hold started pools" in instance
    return out, snapshots


def boot(tmp_path_factory, out: Path, snapshots: Path, **env: str):
    """The instance of the layouts in OUT, booted with SNAPSHOT_DIR=SNAPSHOTS, ready."""
    return start(tmp_path_factory, "boot", {name: str(out / name) for name in SOURCES}, SNAPSHOT_DIR=str(snapshots),
                 **(INSTANCE | {"POOL_MEMORY_GB": "1"} | env))


def interleaved_jobs() -> list[tuple[str, int]]:
    return [(name, i) for i in range(len(PROMPTS)) for name in SOURCES]


def test_the_image_holds_every_models_engine_and_is_checked(baked, sources):
    out, snapshots = baked
    image = SnapshotImage.read(snapshots / "process")
    assert image.model_dirs == {name: str((out / name).resolve()) for name in SOURCES}
    assert image.fingerprint.placements == "a: cpu:0, cpu:1; b: cpu:0, cpu:1"
    assert set(json.loads(image.fingerprint.model_hash)) == set(SOURCES)
    assert image.verify_restore_s > 0 and set(image.digests) == set(image.files)
    assert sorted(p.name for p in snapshots.iterdir()) == ["process"]  # no temporary left (materialized: no GPU)


@pytest.fixture(scope="module")
def restored(baked, tmp_path_factory):
    """The instance restored from the image, its pools holding both models."""
    srv = boot(tmp_path_factory, *baked)
    yield srv
    assert srv.stop() == 0  # SIGTERM forwarded to the restored runtime, which drained and exited 0


def test_restored_instance_serves_each_models_own_output(restored, expected):
    health = http_get(restored, "/health")
    assert health["restore_path"] == "process"
    assert health["skipped"]["gpu"].startswith("a several-model instance has no gpu snapshot")
    assert "process" not in health["skipped"]
    verify = next(s for s in health["stages"] if s["stage"] == "snapshot_verify")
    restore = next(s for s in health["stages"] if s["stage"] == "restore")
    assert verify["detail"]["snapshot"] == "process" and verify["start_s"] < restore["end_s"]
    jobs = interleaved_jobs() * 2
    assert [complete(restored, name, PROMPTS[i]) for name, i in jobs] == [expected[job] for job in jobs]
    pools = http_get(restored, "/health")["pools"]
    assert sorted(pools) == ["cpu:0", "cpu:1"] and all(sorted(p["models"]) == ["a", "b"] for p in pools.values())
    assert "process snapshot: CRIU restored pid" in restored.log()


def test_a_pool_too_small_for_both_evicts_and_reloads_restored_engines(baked, restored, expected,
                                                                       tmp_path_factory):
    """Round-robin keeps the baked placement (every model on both devices) and sends each model to each
    device in turn; a budget short of both models' weights by half the smaller makes switches evict."""
    complete(restored, "a", PROMPTS[0])
    pool = http_get(restored, "/health")["pools"]["cpu:0"]  # a resident there since the start
    models = pool["models"].values()
    buffers = pool["budget_bytes"] - pool["free_bytes"] - sum(m["resident_bytes"] + m["kv_bytes"] for m in models)
    weights = [m["total_bytes"] for m in models]
    budget = sum(weights) + max(m["kv_bytes"] for m in models) + buffers - min(weights) // 2
    srv = boot(tmp_path_factory, *baked, POOL_MEMORY_GB=str(budget / 2**30), PLACEMENT="round-robin")
    try:
        assert http_get(srv, "/health")["restore_path"] == "process"
        order = [("a", 0), ("b", 1), ("a", 2), ("b", 0), ("a", 1), ("b", 2), ("a", 0), ("b", 1)]
        assert [complete(srv, name, PROMPTS[i]) for name, i in order] == [expected[job] for job in order]
        loads = [m["loads"] for p in http_get(srv, "/health")["pools"].values() for m in p["models"].values()]
        assert sum(loads) > len(loads)  # evicted by the other model, then loaded again
    finally:
        srv.stop()


def same_size_edit(path: Path) -> None:
    with open(path, "r+b") as f:
        f.seek(path.stat().st_size // 2)
        chunk = f.read(64)
        f.seek(-64, 1)
        f.write(bytes(b ^ 0x20 for b in chunk))


def test_an_edited_image_is_refused_and_the_instance_starts_fresh(baked, expected, tmp_path, tmp_path_factory):
    out, snapshots = baked
    copy = tmp_path / "snapshots"
    shutil.copytree(snapshots, copy)
    pages = max((copy / "process" / IMAGES).glob("pages-*.img"), key=lambda p: p.stat().st_size)
    same_size_edit(pages)
    srv = boot(tmp_path_factory, out, copy)
    try:
        health = http_get(srv, "/health")
        assert health["restore_path"] == "cold"
        assert health["skipped"]["process"] == (
            f"process snapshot image file {pages.name} does not match its xxh3-128-parts digest from the bake: the "
            "snapshot was changed after it was baked")
        assert children_of(srv.process.pid) == []  # the restored process was killed before its hand-over
        jobs = interleaved_jobs()
        assert [complete(srv, name, PROMPTS[i]) for name, i in jobs] == [expected[job] for job in jobs]
    finally:
        srv.stop()


def test_a_model_changed_after_the_bake_is_refused_by_name(baked, tiny_model, tmp_path, tmp_path_factory):
    """b's layout is built again from another model: the image's engine of b no longer fits it."""
    out, snapshots = baked
    changed = tmp_path / "models"
    shutil.copytree(out, changed)
    shutil.rmtree(changed / "b")
    r = faas_build("--model", tiny_model("tiny-qwen3"), "--out", str(changed / "b"), "--dtype", "float32",
                   "--chunk-mb", "0.125", "--quiet")
    assert r.returncode == 0, r.stderr
    srv = boot(tmp_path_factory, changed, snapshots)
    try:
        health = http_get(srv, "/health")
        assert health["restore_path"] == "cold"
        assert health["skipped"]["process"].startswith("fingerprint mismatch: model_hash of b baked 'sha256:")
        assert complete(srv, "b", PROMPTS[1]) == served_text(tiny_model("tiny-qwen3"), PROMPTS[1], MAX_TOKENS)
    finally:
        srv.stop()


def test_another_device_set_is_refused(baked, expected, tmp_path_factory):
    srv = boot(tmp_path_factory, *baked, POOL_CPU_DEVICES="1")
    try:
        health = http_get(srv, "/health")
        assert health["restore_path"] == "cold"
        assert health["skipped"]["process"] == ("fingerprint mismatch: placements baked 'a: cpu:0, cpu:1; b: cpu:0, "
                                                "cpu:1', here 'a: cpu; b: cpu'")
        assert complete(srv, "b", PROMPTS[2]) == expected[("b", 2)]
    finally:
        srv.stop()
