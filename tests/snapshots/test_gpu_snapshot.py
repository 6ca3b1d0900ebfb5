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


def weights_stage(state: dict) -> dict:
    return next(s for s in state["stages"] if s["stage"] == "weights")


def test_gpu_snapshot_serves_like_a_cold_start(tiny_model_dir, tmp_path):
    """Both kinds of gpu snapshot: weights and KV cache left out of the image (the default: a small image,
    the weights streamed by the CUDA restore helper during the restore, or by the restored process after
    it), and everything in the image."""
    from runtime.weights.layout import write_layout
    from snapshots.gpu import bake_gpu_snapshot

    layout = tmp_path / "layout" / "tiny-llama"  # the helper streams faas-build layouts, as a function's image holds
    write_layout(str(tiny_model_dir), str(layout), dtype="bfloat16", file_bytes=1 << 20, chunk_bytes=1 << 18,
                 progress=False)
    cold = start_server(tmp_path, "cold", MODEL=str(layout), API_KEY=API_KEY, **GPU_ENV)
    try:
        cold.wait_ready(timeout=300)
        cold_text = greedy_text(cold)
    finally:
        cold.stop()

    sizes = {}
    runs = [("stream", "1", "during"), ("stream", "0", "after"), ("image", "1", None)]
    for weights, during_restore, expect in runs:
        env = {**GPU_ENV, "GPU_SNAPSHOT_WEIGHTS": weights}
        snapshot_dir = tmp_path / f"snapshots-{weights}"
        if weights not in sizes:
            image = bake_gpu_snapshot(Settings.from_env({"MODEL": str(layout), **env}), layout, snapshot_dir)
            baked = SnapshotImage.read(snapshot_dir / "gpu")
            assert baked.fingerprint.gpu_model == image.fingerprint.gpu_model != "none"
            assert image.weights_left_out == (weights == "stream")
            sizes[weights] = image.size_bytes
        server = start_server(tmp_path, f"gpu-{weights}-{during_restore}", MODEL=str(layout),
                              SNAPSHOT_DIR=str(snapshot_dir), API_KEY=API_KEY, WEIGHTS_DURING_RESTORE=during_restore,
                              **env)
        try:
            server.wait_ready(timeout=120)
            state = httpx.get(f"{server.url}/health", timeout=5).json()
            assert state["restore_path"] == "gpu", state
            assert "restore" in state["timeline"]
            # left out: the weights stage is their way back; in the image: no load at all
            assert ("weights" in state["timeline"]) == (expect is not None), state["timeline"]
            if expect is not None:
                detail = weights_stage(state)["detail"]
                assert detail.get("during_restore", False) == (expect == "during"), detail
                assert detail.get("after_restore", False) == (expect == "after"), detail
            assert greedy_text(server) == cold_text
        finally:
            assert server.stop() == 0
    # the KV cache (most of the 2.4 GB the engine holds at GPU_MEMORY_UTILIZATION=0.03) is not in the image
    assert sizes["image"] - sizes["stream"] > 1e9, sizes


def test_a_helper_that_cannot_stream_leaves_it_to_the_restored_process(tiny_model_dir, tmp_path):
    """A model directory that is not a layout (the helper streams layouts only): the restored process loads
    the weights itself, says why in the weights stage, and serves the same text."""
    from snapshots.gpu import bake_gpu_snapshot

    env = {**GPU_ENV, "GPU_SNAPSHOT_WEIGHTS": "stream"}
    snapshot_dir = tmp_path / "snapshots"
    bake_gpu_snapshot(Settings.from_env({"MODEL": str(tiny_model_dir), **env}), tiny_model_dir, snapshot_dir)
    texts = []
    for name in ("cold", "gpu"):
        server = start_server(tmp_path, name, MODEL=str(tiny_model_dir), API_KEY=API_KEY, **env,
                              **({"SNAPSHOT_DIR": str(snapshot_dir)} if name == "gpu" else {}))
        try:
            server.wait_ready(timeout=300)
            state = httpx.get(f"{server.url}/health", timeout=5).json()
            texts.append(greedy_text(server))
        finally:
            assert server.stop() == 0
    assert state["restore_path"] == "gpu", state
    detail = weights_stage(state)["detail"]
    assert detail["after_restore"] and "not a faas-build layout" in detail["helper"], detail
    assert texts[0] == texts[1]
