"""KV blocks on demand from the pool: a model's cache grows by taking back retained weights of idle models,
and where nothing more can be had the scheduler preempts; every request completes with the model's own
output."""

import asyncio

import pytest
import torch

from runtime.engine import SamplingParams
from runtime.pool.pool import ModelPool
from tests.pool.helpers import build, make_layout

#: eight requests of 40 tokens: 3 blocks each, 24 blocks at once
PROMPTS = [[3 + i, 40 + i, 7, 99, 12 + i, 5, 8, 61] * 2 for i in range(8)]
MAX_TOKENS = 24
#: room for what the engine allocates itself (the rope table: 8 KiB)
SLACK = 16 << 10
CONFIG = dict(max_num_seqs=8)


@pytest.fixture(scope="module")
def layouts(tiny_model, tmp_path_factory):
    root = tmp_path_factory.mktemp("pool-kv")
    return {p: make_layout(tiny_model(p), root / p) for p in ("tiny-llama", "tiny-qwen2")}


async def all_at_once(engine):
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True)

    async def one(prompt):
        return [t async for o in engine.generate(prompt, params) for t in o.token_ids]

    return await asyncio.gather(*[one(p) for p in PROMPTS])


@pytest.fixture(scope="module")
def expected(layouts):
    engine = build(layouts["tiny-llama"], **CONFIG)
    engine.start()
    try:
        return asyncio.run(all_at_once(engine))
    finally:
        engine.shutdown()


def sizes(layouts):
    probe = ModelPool(torch.device("cpu"), 1 << 40)
    for name, layout in layouts.items():
        probe.add(name, build(layout, **CONFIG))
    return probe._models["tiny-llama"], probe._models["tiny-qwen2"]


def serve(pool, name):
    pool.activate(name)
    pool.hold(name)
    try:
        return asyncio.run(all_at_once(pool.engine(name)))
    finally:
        pool.release(name)


def test_kv_grows_into_retained_weights_of_an_idle_model(layouts, expected):
    llama, qwen = sizes(layouts)
    all_blocks = 25 * llama.kv.block_bytes
    # both models' weights and a first KV chunk each, and 8 blocks more: the rest must come from qwen
    budget = llama.total_bytes + qwen.total_bytes + 2 * llama.kv.chunk_bytes + 8 * llama.kv.block_bytes + SLACK
    pool = ModelPool(torch.device("cpu"), budget)
    try:
        for name, layout in layouts.items():
            pool.add(name, build(layout, **CONFIG))
        pool.activate("tiny-qwen2")
        pool.activate("tiny-llama")
        assert pool.stats().models["tiny-qwen2"].resident_bytes == qwen.total_bytes
        assert serve(pool, "tiny-llama") == expected
        stats = pool.stats()
        assert stats.models["tiny-llama"].kv_bytes > budget - llama.total_bytes - qwen.total_bytes
        assert stats.models["tiny-qwen2"].resident_bytes < qwen.total_bytes  # it gave weights to the KV cache
        assert stats.models["tiny-llama"].kv_bytes <= all_blocks + llama.kv.chunk_bytes
        assert pool.engine("tiny-llama").stats().kv_blocks_used == 0
    finally:
        pool.shutdown()


def test_kv_pressure_preempts_and_completes_every_request(layouts, expected):
    llama, _ = sizes(layouts)
    # the weights and 12 blocks: half of what the eight requests would hold at once
    pool = ModelPool(torch.device("cpu"), llama.total_bytes + 12 * llama.kv.block_bytes + SLACK)
    try:
        pool.add("tiny-llama", build(layouts["tiny-llama"], **CONFIG))
        assert serve(pool, "tiny-llama") == expected
        stats = pool.stats()
        assert stats.models["tiny-llama"].kv_bytes <= 12 * llama.kv.block_bytes + SLACK  # never all 24 at once
        assert stats.used_bytes <= stats.budget_bytes
    finally:
        pool.shutdown()


def test_an_idle_models_kv_cache_goes_back_before_any_weights(layouts, expected):
    llama, qwen = sizes(layouts)
    budget = llama.total_bytes + qwen.total_bytes + 24 * llama.kv.block_bytes + SLACK
    pool = ModelPool(torch.device("cpu"), budget)
    try:
        for name, layout in layouts.items():
            pool.add(name, build(layout, **CONFIG))
        assert serve(pool, "tiny-llama") == expected
        grown = pool.stats().models["tiny-llama"].kv_bytes
        assert grown > 2 * llama.kv.chunk_bytes
        report = pool.activate("tiny-qwen2")
        # its KV cache past the first chunk only: its weights stay, and so does the chunk they run with
        assert report.evicted == {"tiny-llama": grown - llama.kv.chunk_bytes}
        kept = pool.stats().models["tiny-llama"]
        assert (kept.resident_bytes, kept.kv_bytes) == (llama.total_bytes, llama.kv.chunk_bytes)
        assert serve(pool, "tiny-llama") == expected
    finally:
        pool.shutdown()


def test_two_models_serving_at_once_share_the_kv_memory_and_both_finish(layouts, expected):
    llama, qwen = sizes(layouts)
    qwen_alone = build(layouts["tiny-qwen2"], **CONFIG)
    qwen_alone.start()
    try:
        qwen_expected = asyncio.run(all_at_once(qwen_alone))
    finally:
        qwen_alone.shutdown()
    # both models' weights and 16 blocks between them: each request of both must wait its turn for blocks
    budget = llama.total_bytes + qwen.total_bytes + 16 * llama.kv.block_bytes + 2 * SLACK
    pool = ModelPool(torch.device("cpu"), budget)
    try:
        for name, layout in layouts.items():
            pool.add(name, build(layout, **CONFIG))
        for name in layouts:
            pool.activate(name)

        async def batch(name):  # held while its requests run, as the server holds a model
            pool.hold(name)
            try:
                return await all_at_once(pool.engine(name))
            finally:
                pool.release(name)

        async def both():
            return await asyncio.gather(batch("tiny-llama"), batch("tiny-qwen2"))

        got_llama, got_qwen = asyncio.run(both())
        assert got_llama == expected
        assert got_qwen == qwen_expected
        stats = pool.stats()
        assert stats.used_bytes <= stats.budget_bytes
    finally:
        pool.shutdown()


def test_a_switched_away_model_keeps_the_prefixes_cached_in_its_first_kv_chunk(layouts):
    llama, qwen = sizes(layouts)
    # the second model's activation is short of half a chunk (the first one's rope table is half the slack):
    # the first model's KV past its first chunk goes
    budget = (llama.total_bytes + 2 * llama.kv.chunk_bytes + qwen.total_bytes + qwen.kv.chunk_bytes
              - llama.kv.chunk_bytes // 2 + SLACK // 2)
    pool = ModelPool(torch.device("cpu"), budget)
    params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)

    async def answer(engine, prompt):
        outs = [o async for o in engine.generate(prompt, params)]
        return [t for o in outs for t in o.token_ids], outs[-1].cached_tokens

    try:
        for name, layout in layouts.items():
            pool.add(name, build(layout, **CONFIG))
        block_size, first = pool.engine("tiny-llama").config.block_size, llama.kv.chunk_blocks
        # its full blocks fill the first chunk (on the host no block is reserved for CUDA graphs' padded rows);
        # one more token opens the next chunk
        prompt = [(7 * i + 3) % 200 for i in range(first * block_size + 1)]
        pool.activate("tiny-llama")
        tokens, cached = asyncio.run(answer(pool.engine("tiny-llama"), prompt))
        assert cached == 0
        report = pool.activate("tiny-qwen2")
        assert report.evicted == {"tiny-llama": llama.kv.chunk_bytes}
        assert pool.stats().models["tiny-llama"].kv_bytes == llama.kv.chunk_bytes
        pool.activate("tiny-llama")
        assert asyncio.run(answer(pool.engine("tiny-llama"), prompt)) == (tokens, first * block_size)
    finally:
        pool.shutdown()
