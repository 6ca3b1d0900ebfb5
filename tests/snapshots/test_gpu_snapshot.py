"""GPU snapshots on the GPU machine: a ready engine checkpointed with the CUDA checkpoint API and CRIU,
restored by faas-bootstrap, serving the same greedy output as a cold start on the same GPU."""

from __future__ import annotations

import httpx
import openai
import pytest

from runtime.config import Settings
from snapshots.image import SnapshotImage
from tests.server.conftest import API_KEY, start_server

pytestmark = [pytest.mark.gpu, pytest.mark.criu]

#: a small KV cache: the GPU snapshot holds all of the engine's GPU memory (0.03 of an H100: 2.4 GB)
GPU_ENV = {"DEVICE": "cuda", "MAX_MODEL_LEN": "2048", "MAX_NUM_SEQS": "16", "GPU_MEMORY_UTILIZATION": "0.03"}


def greedy_text(server) -> str:
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key=API_KEY, max_retries=0, timeout=120)
    r = client.completions.create(model="tiny-llama", prompt="The GPU snapshot restores", max_tokens=24,
                                  temperature=0.0, extra_body={"ignore_eos": True})
    return r.choices[0].text


def test_gpu_snapshot_serves_like_a_cold_start(tiny_model_dir, tmp_path):
    """Both kinds of gpu snapshot: weights and KV cache streamed back after restore (the default, a small
    image), and everything in the image."""
    from snapshots.gpu import bake_gpu_snapshot

    cold = start_server(tmp_path, "cold", MODEL=str(tiny_model_dir), API_KEY=API_KEY, **GPU_ENV)
    try:
        cold.wait_ready(timeout=300)
        cold_text = greedy_text(cold)
    finally:
        cold.stop()

    sizes = {}
    for weights in ("stream", "image"):
        env = {**GPU_ENV, "GPU_SNAPSHOT_WEIGHTS": weights}
        snapshot_dir = tmp_path / f"snapshots-{weights}"
        image = bake_gpu_snapshot(Settings.from_env({"MODEL": str(tiny_model_dir), **env}), tiny_model_dir,
                                  snapshot_dir)
        assert SnapshotImage.read(snapshot_dir / "gpu").fingerprint.gpu_model == image.fingerprint.gpu_model != "none"
        sizes[weights] = image.size_bytes
        server = start_server(tmp_path, f"gpu-{weights}", MODEL=str(tiny_model_dir), SNAPSHOT_DIR=str(snapshot_dir),
                              API_KEY=API_KEY, **env)
        try:
            server.wait_ready(timeout=120)
            state = httpx.get(f"{server.url}/health", timeout=5).json()
            assert state["restore_path"] == "gpu", state
            assert "restore" in state["timeline"]
            # streamed: the weights stage is the load after the restore; in the image: no load at all
            assert ("weights" in state["timeline"]) == (weights == "stream"), state["timeline"]
            assert greedy_text(server) == cold_text
        finally:
            assert server.stop() == 0
    # the KV cache (most of the 2.4 GB the engine holds at GPU_MEMORY_UTILIZATION=0.03) is not in the image
    assert sizes["image"] - sizes["stream"] > 1e9, sizes
