"""The materialized restore path as far as a CPU shows it: the baked KV-cache size is used when the
snapshot's fingerprint fits, and a mismatched one falls back to the cold path with the reason at /health.
(The CUDA graph half is tested on the GPU: tests/test_materialized_gpu.py.)"""

from __future__ import annotations

import json

import httpx

from runtime.config import Settings
from runtime.engine.model_runner import KVProfile
from snapshots.fingerprint import current_fingerprint, gpu_identity
from snapshots.materialized import DIRNAME, FINGERPRINT, write_digests
from tests.server.conftest import start_server

ENV = {"DEVICE": "cpu", "MAX_MODEL_LEN": "2048", "MAX_NUM_SEQS": "16"}
BAKED_BLOCKS = 77  # not what profiling would find on this machine


def bake_materialized_kv(snapshot_dir, model, **fingerprint_changes) -> None:
    directory = snapshot_dir / DIRNAME
    directory.mkdir(parents=True)
    (directory / "kvprofile.json").write_text(json.dumps(KVProfile(BAKED_BLOCKS, 4096, 0, 0, 0).as_dict()))
    fingerprint = current_fingerprint(Settings.from_env({"MODEL": str(model), **ENV})).as_dict()
    (directory / FINGERPRINT).write_text(json.dumps(fingerprint | fingerprint_changes))
    write_digests(directory)


def boot(tmp_path, model, snapshot_dir) -> dict:
    server = start_server(tmp_path, "boot", MODEL=str(model), SNAPSHOT_DIR=str(snapshot_dir), **ENV)
    try:
        server.wait_ready()
        return httpx.get(f"{server.url}/health", timeout=5).json()
    finally:
        server.stop()


def test_materialized_kv_size_is_restored(tiny_model_dir, tmp_path):
    bake_materialized_kv(tmp_path / "snapshots", tiny_model_dir)
    state = boot(tmp_path, tiny_model_dir, tmp_path / "snapshots")
    assert state["restore_path"] == "materialized"
    assert state["engine"]["kv_blocks_total"] == BAKED_BLOCKS
    assert next(s for s in state["stages"] if s["stage"] == "snapshot_verify")["detail"]["snapshot"] == "materialized"
    assert state["skipped"]["process"] == f"no snapshot at {tmp_path / 'snapshots' / 'process'}"


def test_a_materialized_file_changed_after_the_bake_is_not_used(tiny_model_dir, tmp_path):
    bake_materialized_kv(tmp_path / "snapshots", tiny_model_dir)
    profile = tmp_path / "snapshots" / DIRNAME / "kvprofile.json"
    profile.write_text(profile.read_text().replace(str(BAKED_BLOCKS), str(BAKED_BLOCKS + 11)))  # same size
    state = boot(tmp_path, tiny_model_dir, tmp_path / "snapshots")
    assert state["restore_path"] == "cold" and state["engine"]["kv_blocks_total"] not in (BAKED_BLOCKS,
                                                                                          BAKED_BLOCKS + 11)
    assert state["skipped"]["materialized"] == (
        "materialized snapshot file kvprofile.json does not match its xxh3-128-parts digest from the bake: the "
        "snapshot was changed after it was baked")
    assert "snapshot_verify" in state["timeline"]


def test_materialized_state_of_another_gpu_is_not_used(tiny_model_dir, tmp_path):
    bake_materialized_kv(tmp_path / "snapshots", tiny_model_dir, gpu_model="NVIDIA Z1000")
    state = boot(tmp_path, tiny_model_dir, tmp_path / "snapshots")
    assert state["restore_path"] == "cold" and state["engine"]["kv_blocks_total"] != BAKED_BLOCKS
    here = gpu_identity()[0]  # 'none' without an NVIDIA driver
    assert state["skipped"]["materialized"] == f"fingerprint mismatch: gpu_model baked 'NVIDIA Z1000', here {here!r}"
