"""The engine under load, through the real server: prefix-cache hits reported to the client and in
/metrics, and a stream that keeps its pace while a long prompt is prefilled beside it."""

from __future__ import annotations

import asyncio
import time

import httpx
import openai
import pytest

from tests.server.conftest import API_KEY, start_server
from tests.server.test_openai_api import metrics

SYSTEM = ("You are a careful assistant. Answer in one short sentence, and never repeat the question. "
          "The quick brown fox jumps over the lazy dog. Paris is the capital of France. ") * 3


@pytest.fixture(scope="module")
def sliced_server(tiny_model_dir, tmp_path_factory):
    """Slices of at most 48 tokens a step."""
    srv = start_server(tmp_path_factory.mktemp("sliced"), "sliced", MODEL=str(tiny_model_dir), API_KEY=API_KEY,
                       MAX_MODEL_LEN="2048", MAX_NUM_SEQS="8", MAX_NUM_BATCHED_TOKENS="48")
    try:
        srv.wait_ready()
        yield srv
    finally:
        srv.stop()


def test_a_shared_system_prompt_is_reported_cached(sliced_server):
    client = openai.OpenAI(base_url=f"{sliced_server.url}/v1", api_key=API_KEY, max_retries=0, timeout=60)
    http = httpx.Client(base_url=sliced_server.url, timeout=60)

    def ask(question: str, **kw):
        return client.chat.completions.create(
            model="tiny-llama", max_tokens=4, temperature=0,
            messages=[{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}], **kw)

    before = metrics(http)
    first = ask("What is the capital of France?")
    second = ask("Who jumps over the dog?")
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    cached = second.usage.prompt_tokens_details.cached_tokens
    assert cached % 16 == 0 and first.usage.prompt_tokens - 16 < cached + 16 * 3 and cached >= 64
    chunks = list(ask("Who jumps over the dog?", stream=True, stream_options={"include_usage": True}))
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens > cached  # its whole prompt was seen before
    after = metrics(http)
    queried = first.usage.prompt_tokens + second.usage.prompt_tokens + chunks[-1].usage.prompt_tokens
    assert after["thawllm_prefix_cache_queries_total"] - before["thawllm_prefix_cache_queries_total"] == queried
    assert after["thawllm_prefix_cache_hits_total"] - before["thawllm_prefix_cache_hits_total"] == \
        cached + chunks[-1].usage.prompt_tokens_details.cached_tokens
    for what in ("queries", "hits"):  # under vLLM's names too
        assert after[f"vllm:prefix_cache_{what}_total{{model_name=tiny-llama}}"] == \
            after[f"thawllm_prefix_cache_{what}_total"]


def test_a_stream_keeps_its_pace_while_a_long_prompt_is_prefilled(sliced_server):
    """A 1,200-token prompt arrives while a stream decodes: it is prefilled 48 tokens a step, and the stream
    gets a token nearly every step meanwhile, so its longest gap is a small part of that prefill."""
    long_prompt = [(37 * i + 11) % 500 + 3 for i in range(1200)]

    async def scenario():
        async with openai.AsyncOpenAI(base_url=f"{sliced_server.url}/v1", api_key=API_KEY, max_retries=0,
                                      timeout=300) as client:
            # logprobs: a chunk for every token, even one whose text is held back (a partial UTF-8 character)
            stream = await client.completions.create(model="tiny-llama", prompt="Once upon a time", max_tokens=800,
                                                     temperature=0, stream=True, logprobs=0,
                                                     extra_body={"ignore_eos": True})
            chunks = stream.__aiter__()
            for _ in range(3):  # the stream is decoding
                await chunks.__anext__()
            started = time.monotonic()
            long_request = asyncio.ensure_future(client.completions.create(
                model="tiny-llama", prompt=long_prompt, max_tokens=1, temperature=0))
            arrivals = []
            while not long_request.done():
                chunk = await chunks.__anext__()
                arrivals += [time.monotonic()] * len(chunk.choices[0].logprobs.tokens)
            finished = time.monotonic()
            await stream.close()
            return started, finished, arrivals, (await long_request).usage.prompt_tokens

    started, finished, arrivals, prompt_tokens = asyncio.run(scenario())
    assert prompt_tokens == 1200
    prefill = finished - started
    gaps = [b - a for a, b in zip([started] + arrivals, arrivals)]
    assert len(arrivals) >= 1200 // 48 // 2, (len(arrivals), prefill)  # a token per two slices at least
    assert max(gaps) < prefill / 2, (max(gaps), prefill)  # a stream frozen for the prefill waits all of it
