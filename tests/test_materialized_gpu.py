"""Materialised KV size and CUDA graphs on the GPU: every restored graph reproduces the captured one bit for
bit in another process, and generation through restored graphs equals generation through captured ones."""

import asyncio
import sys
from pathlib import Path

import pytest

from runtime.engine import EngineConfig, SamplingParams
from runtime.launch import build_engine
from snapshots.materialized import bake_materialized, load_kv_blocks
from snapshots.cudagraph.probe import probe_graphs
from snapshots.cudagraph.restore import MaterializedGraphs

pytestmark = pytest.mark.gpu
PROMPTS = [[11 + i, 27, 301, 45 + 3 * i, 7] * (2 + 3 * i) for i in range(8)]


@pytest.fixture(scope="session")
def gpu_model(tmp_path_factory):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from scripts.model_shapes import make_random_model_dir

    return lambda shape: make_random_model_dir(tmp_path_factory.mktemp(shape), shape)


def greedy(engine):
    async def one(prompt):
        params = SamplingParams(max_tokens=32, temperature=0, ignore_eos=True)
        return [t async for out in engine.generate(prompt, params) for t in out.token_ids]

    # One request at a time: concurrent requests join the batch in an order that depends on thread timing,
    # and on random bf16 weights a different batch composition (another GEMM shape) can flip a near-tie.
    async def everything():
        return [await one(p) for p in PROMPTS]

    return asyncio.run(everything())


@pytest.mark.parametrize("shape", ["smollm2-135m", "qwen2-1.5b"])
def test_restored_graphs_are_bit_identical_and_generate_the_same(shape, gpu_model, tmp_path):
    model_dir = gpu_model(shape)
    config = EngineConfig(device="cuda", dtype="bfloat16", max_model_len=1024, max_num_seqs=256,
                          gpu_memory_utilization=0.5)
    report = bake_materialized(model_dir, config, tmp_path)
    assert report.validated, report.problems
    assert report.graphs == 35  # 1, 2, 4 and every multiple of 8 up to 256, each checked bit for bit

    materialized = tmp_path / "materialized"
    captured = build_engine(model_dir, config)
    try:
        captured.start(kv_blocks=load_kv_blocks(materialized))  # same KV size; graphs captured live
        expected = greedy(captured)
        expected_logits = probe_graphs(captured.runner)
    finally:
        captured.shutdown()

    restored = build_engine(model_dir, config)
    try:
        restored.start(kv_blocks=load_kv_blocks(materialized), graph_restorer=MaterializedGraphs(materialized))
        assert restored.graph_fallbacks == {}
        assert sorted(restored.runner.graphs) == sorted(config.cuda_graph_batch_sizes)
        assert restored.timeline.get("cuda_graphs").detail["restored"] is True
        assert greedy(restored) == expected
    finally:
        restored.shutdown()

    # The default for a function: graphs up to batch 8 before ready, the rest built while it already serves.
    deferred = build_engine(model_dir, config)
    try:
        deferred.start(kv_blocks=load_kv_blocks(materialized),
                       graph_restorer=MaterializedGraphs(materialized, before_ready_up_to=8))
        assert deferred.timeline.get("cuda_graphs").detail["pending"] == 31
        assert greedy(deferred) == expected                      # served while the other 31 are being built
        assert deferred.wait_for_graphs(timeout=120)
        assert deferred.graph_fallbacks == {}
        assert sorted(deferred.runner.graphs) == sorted(config.cuda_graph_batch_sizes)
        assert deferred.timeline.get("graphs_after_ready").detail["built"] == 31
        assert probe_graphs(deferred.runner) == expected_logits  # all 35 bit for bit, built live or after ready
    finally:
        deferred.shutdown()
