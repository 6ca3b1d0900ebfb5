"""Automatic prefix caching: a prompt that starts like an earlier one reuses its KV blocks and computes only
the rest, and what it generates is what a cold prefill generates."""

import asyncio

import pytest
import torch

from runtime.engine import SamplingParams
from tests.test_engine import PROMPTS, collect, hf_greedy, tokens

PREFIX = [(37 * i + 11) % 500 + 3 for i in range(45)]   # 2 full blocks of 16, and 13 tokens more


def prompt(tail_seed: int, length: int = 9) -> list[int]:
    return PREFIX + [(53 * i + 7 * tail_seed) % 500 + 3 for i in range(length)]


def served(outs):
    return tokens(outs), [lp.logprob for o in outs for lp in o.logprobs or []], outs[-1].cached_tokens


SAMPLINGS = [dict(temperature=0, logprobs=3), dict(temperature=0.9, top_p=0.9, seed=7, logprobs=0)]


@pytest.mark.parametrize("params", SAMPLINGS, ids=["greedy", "seeded"])
def test_prefix_hit_serves_what_a_cold_prefill_serves(params, tiny_model, engine_factory):
    model_dir = tiny_model("tiny-llama")
    cold = engine_factory(model_dir, enable_prefix_caching=False)
    warm = engine_factory(model_dir)
    requests = [prompt(1), prompt(2), prompt(2), PREFIX[:32] + [9], PREFIX[:33]]
    expected = [served(asyncio.run(collect(cold, p, max_tokens=12, **params))) for p in requests]
    got = [served(asyncio.run(collect(warm, p, max_tokens=12, **params))) for p in requests]

    assert [t for t, _, _ in got] == [t for t, _, _ in expected]
    assert [lp for _, lps, _ in got for lp in lps] == pytest.approx([lp for _, lps, _ in expected for lp in lps],
                                                                     abs=1e-4)
    # the first computes all; the others find the full blocks of what came before: PREFIX's two, or prompt(2)'s
    # three (its last token is computed all the same: its logits are the first token's), or the first two
    assert [c for _, _, c in got] == [0, 32, 48, 32, 32]
    assert [c for _, _, c in expected] == [0] * 5
    if params["temperature"] == 0:
        assert got[1][0] == hf_greedy(model_dir, prompt(2), 12)[0]
    stats = warm.stats()
    assert stats.prefix_cache_hits == 144 and stats.prefix_cache_queries == sum(map(len, requests))
    assert stats.kv_blocks_used == 0 and cold.stats().prefix_cache_queries == 0


def test_generated_tokens_are_cached_for_the_next_turn(tiny_model, engine_factory):
    """A conversation's next turn starts with the last turn's prompt and answer: both are found cached."""
    engine = engine_factory(tiny_model("tiny-llama"))
    first = tokens(asyncio.run(collect(engine, PREFIX, max_tokens=30, temperature=0)))
    turn = PREFIX + first + [17, 18, 19]
    outs = asyncio.run(collect(engine, turn, max_tokens=4, temperature=0))
    assert outs[-1].cached_tokens == (len(PREFIX) + len(first) - 1) // 16 * 16 == 64


def test_least_recently_used_prefix_is_evicted_under_block_pressure(tiny_model, engine_factory):
    model_dir = tiny_model("tiny-llama")
    engine = engine_factory(model_dir, num_kv_blocks=8, max_model_len=128)  # 128 token slots
    other = [(91 * i + 5) % 500 + 3 for i in range(33)]
    unrelated = [(29 * i + 1) % 500 + 3 for i in range(90)]

    def run(p):
        return asyncio.run(collect(engine, p, max_tokens=1, temperature=0))[-1]

    first = run(PREFIX[:33])
    assert run(other).cached_tokens == 0
    assert run(PREFIX[:33]).cached_tokens == 32      # used again: now the most recently used
    # 6 blocks: the 4 empty ones and the 2 of the least recently used prefix, `other`'s
    assert run(unrelated).cached_tokens == 0
    again = run(PREFIX[:33])
    assert again.cached_tokens == 32 and again.token_ids == first.token_ids
    assert run(other).cached_tokens == 0
    assert engine.stats().kv_blocks_used == 0


def test_a_shared_block_is_never_written(tiny_model, engine_factory):
    """While one request decodes on a prefix, another claims the same blocks, prefills its own tail and
    decodes beside it: the shared blocks' keys and values do not change, and both get what they get alone."""
    model_dir = tiny_model("tiny-llama")
    engine = engine_factory(model_dir)
    alone = engine_factory(model_dir, enable_prefix_caching=False)
    first, second = PREFIX + [4, 5, 6], PREFIX[:40] + [7, 8, 9, 10]
    expected = [tokens(asyncio.run(collect(alone, p, max_tokens=n, temperature=0))) for p, n in ((first, 150),
                                                                                                 (second, 40))]

    async def together():
        stream = engine.generate(first, SamplingParams(max_tokens=150, temperature=0, ignore_eos=True))
        got = list((await stream.__anext__()).token_ids)
        (request,) = engine._requests.values()
        shared = request.seq.block_table[:2]
        before = [(k[shared].clone(), v[shared].clone()) for k, v in engine.runner.kv_caches]
        outs = []
        async for o in engine.generate(second, SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)):
            outs.append(o)
            assert not request.seq.finished  # the first still holds the blocks
        async for o in stream:
            got.extend(o.token_ids)
        after = [(k[shared], v[shared]) for k, v in engine.runner.kv_caches]
        return got, outs, before, after

    got, outs, before, after = asyncio.run(together())
    assert outs[-1].cached_tokens == 32
    assert [got, tokens(outs)] == expected
    assert all(torch.equal(b, a) for pair_b, pair_a in zip(before, after) for b, a in zip(pair_b, pair_a))


def check_slices_and_prefix_hits_match_transformers(model_dir, engine_factory, **engine_config):
    """Prompts that find a 32-token prefix cached, prefilled in slices of 24 tokens beside the decodes of the
    others, then decoding together: transformers' greedy tokens, EOS included (ignore_eos goes on past it)."""
    engine = engine_factory(model_dir, dtype="float32", max_num_seqs=16, max_model_len=256,
                            max_num_batched_tokens=24, num_kv_blocks=64, **engine_config)
    prompts = [PROMPTS[7] + p for p in PROMPTS[:5]]  # a 32-token prefix, then 2 to 20 tokens of their own
    expected = [hf_greedy(model_dir, p, 16)[0] for p in prompts]
    # the third prompt's greedy answer holds EOS as its second token: what follows is generated past it
    assert engine.tokenizer.eos_token_ids & set(expected[2])
    first = asyncio.run(collect(engine, prompts[0], max_tokens=16, temperature=0))

    async def the_rest():
        return await asyncio.gather(*[collect(engine, p, max_tokens=16, temperature=0) for p in prompts[1:]])

    rest = asyncio.run(the_rest())
    assert [tokens(o) for o in [first, *rest]] == expected
    assert first[-1].cached_tokens == 0 and [o[-1].cached_tokens for o in rest] == [32] * 4
    assert engine.stats().kv_blocks_used == 0


def test_prompt_slices_and_prefix_hits_match_transformers(tiny_model, engine_factory):
    check_slices_and_prefix_hits_match_transformers(tiny_model("tiny-llama"), engine_factory)
