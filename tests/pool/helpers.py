"""Helpers of the pool tests: tiny models as faas-build layouts with small chunks, engines built on them,
and greedy generation."""

from __future__ import annotations

import asyncio
from pathlib import Path

from runtime.engine import EngineConfig, SamplingParams
from runtime.weights.layout import write_layout

PROMPTS = [[5, 9, 33, 100, 7], [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11], [250, 17]]
PRESETS = ("tiny-llama", "tiny-qwen2", "tiny-qwen3")
#: small chunks, so that a tiny model has several groups (about one per decoder layer)
CHUNK_BYTES = 32 << 10
CONFIG = dict(device="cpu", max_model_len=64, max_num_seqs=4)


def make_layout(model_dir: str, out: Path) -> Path:
    write_layout(model_dir, str(out), dtype="float32", chunk_bytes=CHUNK_BYTES, file_bytes=256 << 10,
                 progress=False)
    return out


def build(layout: Path, **config):
    from runtime.engine.llm_engine import Engine
    from runtime.weights.loader import LayoutLoader

    return Engine.build(layout, LayoutLoader(layout), EngineConfig(**{**CONFIG, **config}))


def greedy(engine, prompt: list[int], n: int = 10) -> list[int]:
    async def run():
        params = SamplingParams(max_tokens=n, temperature=0, ignore_eos=True)
        return [t async for o in engine.generate(prompt, params) for t in o.token_ids]

    return asyncio.run(run())
