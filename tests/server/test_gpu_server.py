"""The server on a CUDA device: the cold path with CUDA graphs, batched streams, a disconnect."""

from __future__ import annotations

import asyncio

import httpx
import openai
import pytest

from tests.server.conftest import start_server
from tests.server.test_openai_api import metrics, wait_for

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

        with httpx.Client(base_url=server.url, timeout=60) as http:
            body = {"prompt": "long", "max_tokens": 3000, "ignore_eos": True, "stream": True}
            with http.stream("POST", "/v1/completions", json=body) as response:
                assert next(response.iter_lines()).startswith("data: ")
                assert metrics(http)["thawllm_kv_blocks_used"] > 0
            wait_for(lambda: metrics(http)["thawllm_kv_blocks_used"] == 0, timeout=3, what="KV blocks freed")
    finally:
        assert server.stop() == 0
    print(server.log())
