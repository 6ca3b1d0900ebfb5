"""The server on a CUDA device: the cold path with CUDA graphs, batched streams, structured outputs cut by
max_tokens in a batch, a disconnect."""

from __future__ import annotations

import asyncio
import json
import re

import httpx
import jsonschema
import openai
import pytest

from tests.server.conftest import start_server
from tests.server.test_openai_api import metrics, wait_for
from tests.server.test_openai_features import CLOSABLE

pytestmark = pytest.mark.gpu


def test_serves_on_cuda(tiny_model_dir, tmp_path):
    server = start_server(tmp_path, "gpu", MODEL=str(tiny_model_dir), DEVICE="cuda", MAX_NUM_SEQS="32")
    try:
        server.wait_ready(timeout=300)
        health = httpx.get(f"{server.url}/health").json()
        assert health["restore_path"] == "cold" and "cuda_graphs" in health["timeline"]
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="-", max_retries=0)
        r = client.chat.completions.create(model="tiny-llama", messages=[{"role": "user", "content": "hi"}],
                                           max_tokens=16, temperature=0, extra_body={"ignore_eos": True})
        assert r.usage.completion_tokens == 16

        async def streams() -> list[str]:
            async with openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key="-", max_retries=0) as c:
                async def one() -> str:
                    text = ""
                    async for chunk in await c.completions.create(
                            model="tiny-llama", prompt="The same prompt", max_tokens=48, temperature=0,
                            stream=True, extra_body={"ignore_eos": True}):
                        text += chunk.choices[0].text
                    return text
                return await asyncio.gather(*(one() for _ in range(16)))

        texts = asyncio.run(streams())
        assert len(set(texts)) == 1 and texts[0]  # greedy: batched decode (CUDA graphs) agrees with itself
        _cut_structured_outputs_close(client, server.url)

        with httpx.Client(base_url=server.url, timeout=60) as http:
            body = {"prompt": "long", "max_tokens": 3000, "ignore_eos": True, "stream": True}
            for _ in range(3):  # the tiny model may finish the stream before /metrics is answered: then again
                with http.stream("POST", "/v1/completions", json=body) as response:
                    assert next(response.iter_lines()).startswith("data: ")
                    seen = metrics(http)
                if seen["thawllm_requests_running"] > 0:
                    break
            assert seen["thawllm_requests_running"] > 0 and seen["thawllm_kv_blocks_used"] > 0, seen
            wait_for(lambda: metrics(http)["thawllm_kv_blocks_used"] == 0, timeout=3, what="KV blocks freed")
    finally:
        assert server.stop() == 0
    print(server.log())


def _cut_structured_outputs_close(client: openai.OpenAI, url: str) -> None:
    """Schema answers cut by max_tokens, batched with plain streams on the CUDA graphs: each is complete."""
    fmt = {"type": "json_schema", "json_schema": {"name": "closable", "schema": CLOSABLE}}
    ask = [{"role": "user", "content": "hi"}]
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model="tiny-llama", messages=ask, response_format=fmt, max_tokens=1)
    shortest = int(re.search(r"takes (\d+) tokens", err.value.body["message"]).group(1))

    async def batch() -> list:
        async with openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="-", max_retries=0) as c:
            cut = [c.chat.completions.create(model="tiny-llama", messages=ask, response_format=fmt, seed=i,
                                             max_tokens=shortest + i) for i in range(12)]
            plain = [c.completions.create(model="tiny-llama", prompt="plain", max_tokens=64, temperature=0,
                                          extra_body={"ignore_eos": True}) for _ in range(8)]
            return await asyncio.gather(*cut, *plain)

    results = asyncio.run(batch())
    for r in results[:12]:
        jsonschema.validate(json.loads(r.choices[0].message.content), CLOSABLE)
        assert r.choices[0].finish_reason in ("length", "stop")
    assert results[0].choices[0].finish_reason == "length"
    assert len({r.choices[0].text for r in results[12:]}) == 1  # the plain rows are untouched by the masks
