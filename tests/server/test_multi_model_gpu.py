"""Several models in one real server on the GPU: each answers exactly as it does served alone on the GPU,
through switches between them (the pool's VMM ranges, the engines' CUDA graphs)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.server.conftest import API_KEY, REPO, server_env, start_server
from tests.server.test_multi_model import PROMPTS, complete, http_get, model_list

pytestmark = pytest.mark.gpu

TWO = ("tiny-llama", "tiny-qwen3")
# one GPU: a several-model instance pools every GPU it sees (tests/server/test_multi_gpu.py takes two)
ENGINE = {"DEVICE": "cuda", "MAX_MODEL_LEN": "256", "MAX_NUM_SEQS": "4", "CUDA_VISIBLE_DEVICES": "0"}


def test_several_models_on_the_gpu_answer_as_each_alone(tmp_path, tiny_model):
    dirs = {name: tiny_model(name) for name in TWO}
    alone = {}
    for name, path in dirs.items():
        srv = start_server(tmp_path, f"alone-{name}", MODEL=path, SERVED_MODEL_NAME=name, API_KEY=API_KEY, **ENGINE)
        try:
            srv.wait_ready(timeout=300)
            alone.update({(name, i): complete(srv, name, prompt) for i, prompt in enumerate(PROMPTS)})
        finally:
            srv.stop()
    srv = start_server(tmp_path, "pooled", MODEL=model_list(dirs), API_KEY=API_KEY, GPU_MEMORY_UTILIZATION="0.5",
                       **ENGINE)
    try:
        srv.wait_ready(timeout=300)
        jobs = [(name, i) for i in range(len(PROMPTS)) for name in TWO] * 2
        assert [complete(srv, name, PROMPTS[i]) for name, i in jobs] == [alone[job] for job in jobs]
        pool = http_get(srv, "/health")["pools"]["cuda"]
        assert all(m["switches"] >= 2 for m in pool["models"].values())
    finally:
        assert srv.stop() == 0


def test_baked_pooled_graphs_are_restored_at_each_models_first_start(tmp_path, tiny_model):
    """faas-build bakes each model's decode graphs against its KV cache in a pool; the instance restores them
    at each model's first start (no capture) and answers as each model alone; a model served alone refuses
    that profile with the reason."""
    dirs = {name: tiny_model(name) for name in TWO}
    out, snapshots = tmp_path / "models", tmp_path / "snapshots"
    pooled = {**ENGINE, "GPU_MEMORY_UTILIZATION": "0.5"}  # baked with the settings the instance boots with
    build = subprocess.run([sys.executable, "-m", "snapshots.build", "--model", model_list(dirs), "--out", str(out),
                            "--snapshot-dir", str(snapshots), "--snapshots", "materialized", "--quiet"],
                           cwd=REPO, env=server_env(**pooled), capture_output=True, text=True, timeout=900)
    assert build.returncode == 0, build.stderr
    for name in TWO:  # each model's summary line says its graphs were baked against the pool's KV range
        section = build.stderr[build.stderr.index(f"{name}:"):]
        assert "materialized  baked" in section and "KV cache's address range in a pool" in section, section
    served = ",".join(f"{name}={out / name}" for name in TWO)
    alone = {}
    for name in TWO:
        srv = start_server(tmp_path, f"alone-{name}", MODEL=str(out / name), SERVED_MODEL_NAME=name,
                           SNAPSHOT_DIR=str(snapshots / name), API_KEY=API_KEY, **ENGINE)
        try:
            srv.wait_ready(timeout=300)
            health = http_get(srv, "/health")
            assert "several-model instance's pool" in health["skipped"]["materialized"]
            alone.update({(name, i): complete(srv, name, prompt) for i, prompt in enumerate(PROMPTS)})
        finally:
            srv.stop()
    srv = start_server(tmp_path, "pooled-baked", MODEL=served, SNAPSHOT_DIR=str(snapshots), API_KEY=API_KEY,
                       **pooled)
    try:
        srv.wait_ready(timeout=300)
        jobs = [(name, i) for i in range(len(PROMPTS)) for name in TWO]
        assert [complete(srv, name, PROMPTS[i]) for name, i in jobs] == [alone[job] for job in jobs]
        health = http_get(srv, "/health")
        assert health["restore_path"] == "materialized", health["skipped"]
        for name, m in health["pools"]["cuda"]["models"].items():  # each model's graphs came from its profile
            first = m["first_start"]
            assert first["graphs_restored"] is True and 0 <= first["kernels_critical_s"] <= first["total_s"], name
    finally:
        assert srv.stop() == 0
    assert "captured live" not in srv.log(), srv.log()[-3000:]

