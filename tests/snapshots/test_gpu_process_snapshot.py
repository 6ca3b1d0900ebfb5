"""A process snapshot of a CUDA engine on the GPU machine: restored by faas-bootstrap, it makes its CUDA
context the moment it resumes, gets its weights from a helper that streams them during the restore (when they
are not in the page cache, or WEIGHTS_DURING_RESTORE=1) or loads them itself (in the page cache: auto), the
helper leaving the embedding table's whole chunks for after ready unless EMBEDDING_LAST=0, and serves the same
greedy tokens and logprobs as a cold start on the same GPU."""

from __future__ import annotations

import httpx
import openai
import pytest

from runtime.config import Settings
from snapshots.bake import bake_snapshots
from tests.server.conftest import API_KEY, start_server

pytestmark = [pytest.mark.gpu, pytest.mark.criu]

GPU_ENV = {"DEVICE": "cuda", "MAX_MODEL_LEN": "2048", "MAX_NUM_SEQS": "16", "GPU_MEMORY_UTILIZATION": "0.05"}


def greedy_tokens(server) -> tuple[list[str], list[float]]:
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key=API_KEY, max_retries=0, timeout=120)
    r = client.completions.create(model="tiny-llama", prompt="The process snapshot restores", max_tokens=24,
                                  temperature=0.0, logprobs=1, extra_body={"ignore_eos": True})
    return r.choices[0].logprobs.tokens, r.choices[0].logprobs.token_logprobs


def stage(state: dict, name: str) -> dict:
    return next(s for s in state["stages"] if s["stage"] == name)


def test_process_snapshot_serves_like_a_cold_start(tiny_model_dir, tmp_path):
    from runtime.weights.layout import write_layout

    layout = tmp_path / "layout" / "tiny-llama"
    # 16 KiB chunks: the 64 KiB embedding table holds four whole ones, which the helper leaves for last
    write_layout(str(tiny_model_dir), str(layout), dtype="bfloat16", file_bytes=1 << 20, chunk_bytes=1 << 14,
                 progress=False)
    snapshot_dir = tmp_path / "snapshots"
    settings = Settings.from_env({"MODEL": str(layout), "SNAPSHOT_DIR": str(snapshot_dir), **GPU_ENV})
    baked = {r.kind: r.status for r in bake_snapshots(settings, layout, kinds=("materialized", "process"))}
    assert baked == {"materialized": "baked", "process": "baked"}, baked

    served, states = {}, {}
    # the layout was just written: in the page cache, so auto leaves the weights to the restored runtime
    for name, restore, during, table_last in (("cold", "cold", "auto", "1"), ("auto", "process", "auto", "1"),
                                              ("helper", "process", "1", "1"), ("whole-table", "process", "1", "0")):
        server = start_server(tmp_path, name, MODEL=str(layout), SNAPSHOT_DIR=str(snapshot_dir), API_KEY=API_KEY,
                              RESTORE=restore, WEIGHTS_DURING_RESTORE=during, EMBEDDING_LAST=table_last, **GPU_ENV)
        try:
            server.wait_ready(timeout=300)
            assert httpx.get(f"{server.url}/health", timeout=5).json()["restore_path"] == restore
            served[name] = greedy_tokens(server)
            states[name] = httpx.get(f"{server.url}/health", timeout=5).json()
        finally:
            assert server.stop() == 0
    # the helper left the table's four whole chunks to the restored runtime, which read them after ready
    helper = stage(states["helper"], "weights")["detail"]
    assert helper["deferred_chunks"] == 4, helper
    assert stage(states["helper"], "embedding_after_ready")["detail"]["bytes"] == 4 << 14, states["helper"]
    assert stage(states["whole-table"], "weights")["detail"]["deferred_chunks"] == 0
    assert not any(s["stage"] == "embedding_after_ready" for s in states["whole-table"]["stages"])
    for name in ("auto", "helper", "whole-table"):
        state = states[name]
        # the context was made by a thread started as the restored runtime resumed, before the engine's start
        cuda_init = stage(state, "cuda_init")
        assert cuda_init["detail"].get("ahead"), state["stages"]
        assert cuda_init["start_s"] <= stage(state, "restore")["end_s"] + 0.05, state["stages"]
        assert stage(state, "cuda_graphs")["detail"]["restored"], state["stages"]
        weights = stage(state, "weights")["detail"]
        assert weights.get("during_restore", False) == (name != "auto"), weights
        # the helper's memory was mapped as it came: the KV cache and graphs were set up before its report
        assert ("waited_s" in weights) == (name != "auto"), weights
    assert len(served["cold"][0]) == 24
    assert served["auto"] == served["cold"] and served["helper"] == served["cold"]
    assert served["whole-table"] == served["cold"]


def test_several_models_process_snapshot_serves_like_a_fresh_start(tiny_model, tmp_path):
    """One image of both models' engines: restored, the first model's CUDA context is made as it resumes, no
    helper streams weights, and each model serves the tokens a fresh several-model start serves."""
    from tests.server.test_multi_model import faas_build

    sources = {"a": tiny_model("tiny-llama"), "b": tiny_model("tiny-qwen2")}
    env = GPU_ENV | {"MAX_MODEL_LEN": "256", "MAX_NUM_SEQS": "4"}  # the tiny models' context
    out, snapshots = tmp_path / "models", tmp_path / "snapshots"
    r = faas_build("--model", ",".join(f"{n}={p}" for n, p in sources.items()), "--out", str(out),
                   "--snapshot-dir", str(snapshots), "--snapshots", "materialized,process", "--quiet", **env)
    assert r.returncode == 0, r.stderr
    served, states = {}, {}
    for name, restore in (("fresh", "cold"), ("restored", "process")):
        server = start_server(tmp_path, name, MODEL=",".join(f"{n}={out / n}" for n in sources), API_KEY=API_KEY,
                              SNAPSHOT_DIR=str(snapshots), RESTORE=restore, **env)
        try:
            server.wait_ready(timeout=300)
            states[name] = httpx.get(f"{server.url}/health", timeout=5).json()
            client = openai.OpenAI(base_url=f"{server.url}/v1", api_key=API_KEY, max_retries=0, timeout=120)
            served[name] = [client.completions.create(model=model, prompt="The process snapshot restores",
                                                      max_tokens=24, temperature=0.0, logprobs=1,
                                                      extra_body={"ignore_eos": True}).choices[0].logprobs.tokens
                            for model in ("a", "b", "a")]
        finally:
            assert server.stop() == 0
        if name == "restored":
            assert "no helper streams weights during the restore" in server.log()
    state = states["restored"]
    assert state["restore_path"] == "process", state["skipped"]
    assert "gpu" in state["skipped"]  # RESTORE=process: the instance's gpu kind is never tried
    assert stage(state, "cuda_init")["detail"].get("ahead"), state["stages"]
    assert all(len(tokens) == 24 for tokens in served["fresh"])
    assert served["restored"] == served["fresh"]


def test_no_start_after_the_bake_compiles_a_kernel_or_runs_ptxas(tiny_model_dir, tmp_path):
    """faas-build compiles every Triton kernel a request runs into the cache the image keeps: neither the start
    it lists the start pages from nor a restored runtime's prompts of any length compile one. A compile costs
    the request that meets it about half a second, and the compiler's pages would be listed as start pages.
    Nor does the restored runtime run ptxas at all: the version Triton asks of it for the GPU's architecture
    was asked before the freeze."""
    from triton import knobs

    from tests.server.test_multi_model import faas_build

    cache, out, snapshots = tmp_path / "triton-cache", tmp_path / "layout" / "tiny-llama", tmp_path / "snapshots"
    runs, ptxas = tmp_path / "ptxas-runs.txt", tmp_path / "ptxas"
    ptxas.write_text(f'#!/bin/sh\necho "$*" >> {runs}\nexec {knobs.nvidia.ptxas.path} "$@"\n')
    ptxas.chmod(0o755)
    env = GPU_ENV | {"TRITON_CACHE_DIR": str(cache), "TRITON_PTXAS_PATH": str(ptxas)}
    r = faas_build("--model", str(tiny_model_dir), "--out", str(out), "--snapshot-dir", str(snapshots),
                   "--snapshots", "materialized,process", "--time-restores", "0", "--quiet", **env)
    assert r.returncode == 0, r.stderr
    assert "process start pages:" in r.stderr, r.stderr  # the start the pages are listed from served its requests
    baked_at = (snapshots / "process" / "manifest.json").stat().st_mtime
    compiled = {path: path.stat().st_mtime for path in cache.rglob("*") if path.is_file()}
    assert any(path.suffix == ".cubin" for path in compiled), sorted(compiled)  # the bake compiled into it
    assert not [path.name for path, at in compiled.items() if at > baked_at]
    assert "--version" in runs.read_text()  # the wrapper is the ptxas the bake ran
    runs.unlink()

    server = start_server(tmp_path, "restored", MODEL=str(out), SNAPSHOT_DIR=str(snapshots), API_KEY=API_KEY,
                          RESTORE="process", **env)
    try:
        server.wait_ready(timeout=300)
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key=API_KEY, max_retries=0, timeout=120)
        # one block of the KV cache is 16 tokens: tables 1, 2, 16, 17, 32 and 94 blocks wide
        for length, temperature in ((5, 0.0), (17, 0.0), (256, 0.0), (257, 0.8), (500, 0.0), (1500, 0.8)):
            prompt = [(7919 * i + 13) % 256 for i in range(length)]
            r = client.completions.create(model="tiny-llama", prompt=prompt, max_tokens=3, temperature=temperature,
                                          extra_body={"ignore_eos": True})
            assert r.usage.prompt_tokens == length and r.usage.completion_tokens == 3
    finally:
        assert server.stop() == 0
    added = sorted(path.name for path in cache.rglob("*") if path.is_file() and path not in compiled)
    assert not added
    assert not runs.exists(), runs.read_text()
