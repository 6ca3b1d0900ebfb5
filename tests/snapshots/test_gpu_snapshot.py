"""GPU snapshots on the GPU machine: a ready engine checkpointed with the CUDA checkpoint API and CRIU,
restored by faas-bootstrap, serving the same greedy output as a cold start on the same GPU."""

from __future__ import annotations

import os
import shutil

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


#: random-weight models of real shapes whose gpu snapshot must serve what a cold start serves;
#: THAWLLM_GPU_SHAPES=qwen2-1.5b,llama-3-8b for the 8B one too (16 GB written, a few minutes)
REAL_SHAPES = os.environ.get("THAWLLM_GPU_SHAPES", "qwen2-1.5b").split(",")
#: each shape's share of an H100, as the GPU benchmarks bake them (docs/benchmarks.md)
SHAPE_MEMORY = {"qwen2-1.5b": "0.12", "llama-3-8b": "0.25"}


def greedy_tokens(server) -> tuple[list[str], list[float]]:
    """48 greedy tokens and their logprobs: a random model's text is mostly empty, so the text alone proves
    nothing, but the tokens and their logprobs name every choice."""
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key=API_KEY, max_retries=0, timeout=300)
    model = client.models.list().data[0].id
    r = client.completions.create(model=model, prompt="The function restores", max_tokens=48, temperature=0.0,
                                  logprobs=1, extra_body={"ignore_eos": True})
    return r.choices[0].logprobs.tokens, r.choices[0].logprobs.token_logprobs


@pytest.mark.parametrize("shape", REAL_SHAPES)
def test_a_real_shapes_snapshots_serve_like_a_cold_start(shape, tmp_path):
    """The default gpu snapshot (weights left out, streamed during the restore, warmed up, the context's
    stack released) and the default process snapshot (weights streamed by a helper during the restore,
    materialised graphs) of a model of a real shape: the same 48 greedy tokens with the same logprobs, to the
    last bit, as a cold start on the same GPU."""
    from runtime.weights.layout import write_layout
    from scripts.model_shapes import make_random_model_dir
    from snapshots.bake import bake_snapshots

    layout = tmp_path / shape
    write_layout(str(make_random_model_dir(tmp_path / "source", shape)), str(layout), dtype="bfloat16",
                 progress=False)
    shutil.rmtree(tmp_path / "source")
    env = {"DEVICE": "cuda", "MAX_MODEL_LEN": "4096", "GPU_MEMORY_UTILIZATION": SHAPE_MEMORY.get(shape, "0.25")}
    snapshot_dir = tmp_path / "snapshots"
    settings = Settings.from_env({"MODEL": str(layout), "SNAPSHOT_DIR": str(snapshot_dir), **env})
    baked = {r.kind: r.status for r in bake_snapshots(settings, layout, kinds=("materialized", "process", "gpu"))}
    assert set(baked.values()) == {"baked"}, baked
    served = {}
    for name in ("cold", "gpu", "process"):
        server = start_server(tmp_path, name, MODEL=str(layout), API_KEY=API_KEY, RESTORE=name,
                              SNAPSHOT_DIR=str(snapshot_dir), **env)
        try:
            server.wait_ready(timeout=600)
            state = httpx.get(f"{server.url}/health", timeout=5).json()
            assert state["restore_path"] == name, state
            served[name] = greedy_tokens(server)
        finally:
            assert server.stop() == 0
    assert len(served["cold"][0]) == 48
    assert served["gpu"] == served["cold"] and served["process"] == served["cold"]
