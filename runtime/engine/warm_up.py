"""Throwaway requests through a started engine, so that what a first request would set up happens now.

A gpu snapshot is taken right after this (snapshots/frozen.py): without it, the first request after every
restore pays for what the bake never ran. The engine's start captures decode graphs and, on a cold start,
profiles one prefill at the largest size; a real first request then loads cuBLAS's kernels for a small
prefill, the sampler's kernels (log-softmax, top-k/top-p, the penalties, seeded draws) and allocates the
pinned buffers its tokens come back through. Prompts of several lengths, run one at a time, reach
cuBLAS's choices for several prefill sizes; then one batch of every sampling path decodes together.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

from runtime.engine.sampling_params import SamplingParams

if TYPE_CHECKING:
    from runtime.engine.llm_engine import Engine

#: prefill lengths served alone (clipped to what the engine takes in one step); cuBLAS picks its kernels by size
PROMPT_LENGTHS = (2, 5, 12, 30, 75, 190, 470, 1180, 2950)
#: every way the sampler can choose a token, decoded together in one batch
SAMPLING_PATHS = (
    SamplingParams(temperature=0.0),
    SamplingParams(temperature=0.0, logprobs=0),
    SamplingParams(temperature=0.0, logprobs=5),
    SamplingParams(temperature=0.8, seed=1),
    SamplingParams(temperature=0.8, top_p=0.9, top_k=40, seed=2, logprobs=1),
    SamplingParams(temperature=0.0, presence_penalty=0.5, frequency_penalty=0.3, repetition_penalty=1.1),
)
#: decode steps per request: enough for the step loop to run ahead of the host at least once
WARM_UP_TOKENS = 4


@dataclass(frozen=True)
class WarmUp:
    requests: int
    prompt_lengths: tuple[int, ...]
    seconds: float


def warm_up(engine: "Engine") -> WarmUp:
    """Serve the throwaway requests and leave the engine as it was: no blocks held, no steps counted.
    Seeded sampling only, so the engine's own generator (unseeded requests) is untouched."""
    started = time.perf_counter()
    capacity = engine.blocks.num_blocks * engine.config.block_size
    longest = min(engine.max_model_len, engine.config.max_num_batched_tokens, capacity) - WARM_UP_TOKENS
    lengths = tuple(n for n in PROMPT_LENGTHS if n <= longest)
    asyncio.run(_serve(engine, lengths))
    if engine.blocks.num_used:
        raise RuntimeError(f"the warm-up left {engine.blocks.num_used} KV blocks in use")
    engine.reset_step_counts()
    return WarmUp(len(lengths) + len(SAMPLING_PATHS), lengths, time.perf_counter() - started)


async def _serve(engine: "Engine", lengths: tuple[int, ...]) -> None:
    vocab = engine.model_config.vocab_size
    for n in lengths:
        await _drain(engine, _prompt(n, vocab), SamplingParams(temperature=0.0, max_tokens=WARM_UP_TOKENS,
                                                               ignore_eos=True, logprobs=1))
    await asyncio.gather(*(
        _drain(engine, _prompt(8 + i, vocab), _throwaway(params)) for i, params in enumerate(SAMPLING_PATHS)))


def _throwaway(params: SamplingParams) -> SamplingParams:
    return dataclasses.replace(params, max_tokens=WARM_UP_TOKENS, ignore_eos=True)


def _prompt(length: int, vocab: int) -> list[int]:
    # spread over the vocabulary, the same every bake: which tokens these are does not matter
    return [(7919 * i + 13) % vocab for i in range(length)]


async def _drain(engine: "Engine", prompt: list[int], params: SamplingParams) -> None:
    async for _ in engine.generate(prompt, params):
        pass
