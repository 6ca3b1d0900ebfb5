"""Chunked prefill: a step's token budget goes to the running decodes first and then to slices of prompts,
each slice attending to the ones before it; what is generated is what a whole prefill generates."""

import asyncio

import pytest

from runtime.engine import SamplingParams
from tests.test_engine import collect, hf_greedy, tokens

LONG = [[(31 * i + 7 * k) % 500 + 3 for i in range(n)] for k, n in enumerate((150, 61, 97, 16, 200))]
REQUESTS = [(LONG[0], dict(temperature=0, logprobs=3)),
            (LONG[1], dict(temperature=0.9, top_k=50, seed=3, logprobs=0)),
            (LONG[2], dict(temperature=0, repetition_penalty=1.3)),
            (LONG[3], dict(temperature=1.0, seed=5)),
            (LONG[4], dict(temperature=0))]


def serve(engine):
    async def together():
        return await asyncio.gather(*[collect(engine, p, max_tokens=10, **kw) for p, kw in REQUESTS])

    return [(tokens(o), [lp.logprob for x in o for lp in x.logprobs or []]) for o in asyncio.run(together())]


@pytest.mark.parametrize("budget", [7, 16, 50])
def test_prompts_prefilled_in_slices_generate_what_whole_prefills_generate(budget, tiny_model, engine_factory):
    model_dir = tiny_model("tiny-llama")
    whole = engine_factory(model_dir, max_num_batched_tokens=1024, enable_prefix_caching=False)
    sliced = engine_factory(model_dir, max_num_batched_tokens=budget, enable_prefix_caching=False)
    expected, got = serve(whole), serve(sliced)
    assert [t for t, _ in got] == [t for t, _ in expected]
    assert [lp for _, lps in got for lp in lps] == pytest.approx([lp for _, lps in expected for lp in lps], abs=1e-4)
    assert got[4][0] == hf_greedy(model_dir, LONG[4], 10)[0]
    # every step held at most `budget` tokens: the prompts alone took this many steps at least
    assert sliced.stats().steps >= sum(len(p) for p, _ in REQUESTS) // budget
    assert sliced.stats().kv_blocks_used == 0


def test_slices_and_prefix_hits_and_preemption_together(tiny_model, engine_factory):
    """Slices of 24 tokens, prompts that share prefixes, and a KV cache too small for all of them at once."""
    model_dir = tiny_model("tiny-llama")
    shared = LONG[0][:70]
    prompts = [shared + LONG[k][:20 + 7 * k] for k in range(1, 5)] + [LONG[0][:100], shared[:40]]

    def run(engine):
        async def together():
            return await asyncio.gather(*[collect(engine, p, max_tokens=24, temperature=0) for p in prompts])

        return [tokens(o) for o in asyncio.run(together())]

    expected = run(engine_factory(model_dir, max_num_batched_tokens=1024, enable_prefix_caching=False))
    engine = engine_factory(model_dir, max_num_batched_tokens=24, num_kv_blocks=14, max_model_len=192)
    assert run(engine) == expected
    stats = engine.stats()
    assert stats.prefix_cache_hits > 0 and stats.kv_blocks_used == 0 and stats.running == stats.waiting == 0


def test_decodes_go_on_while_a_long_prompt_is_prefilled(tiny_model, engine_factory):
    """Running decodes take the budget first: a stream keeps getting a token every step while a prompt ten
    times the budget is prefilled beside it, one slice a step."""
    engine = engine_factory(tiny_model("tiny-llama"), max_num_batched_tokens=32)
    long_prompt = [(17 * i + 5) % 500 + 3 for i in range(320)]

    async def scenario():
        stream = engine.generate(LONG[3], SamplingParams(max_tokens=200, temperature=0, ignore_eos=True))
        await stream.__anext__()
        steps_before = engine.stats().steps
        long_request = asyncio.ensure_future(collect(engine, long_prompt, max_tokens=1, temperature=0))
        during = 0
        while not long_request.done():
            out = await stream.__anext__()
            during += len(out.token_ids)
        await stream.aclose()
        return during, engine.stats().steps - steps_before

    during, steps = asyncio.run(scenario())
    assert steps >= 10          # the prompt took ten steps or more, 32 tokens each at most
    assert during >= steps - 3  # and the stream got a token from nearly every one of them
