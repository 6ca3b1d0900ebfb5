"""Throwaway requests through a started engine, so that what a first request would set up happens now.

A gpu snapshot is taken right after this (snapshots/frozen.py): without it, the first request after every
restore pays for what the bake never ran. The engine's start captures decode graphs and, on a cold start,
profiles one prefill at the largest size; a first request then loads cuBLAS's kernels for a small prefill
and the sampler's kernels, lazily, from torch's libraries.

Loading a kernel module costs host memory, which the snapshot's image carries into every restore (CRIU
reads it back at about 1.5 GiB/s). Measured on the H100 (Qwen2-1.5B; first request against the same one
again): greedy +8 MiB for 16 ms saved, temperature sampling +14 MiB for 19 ms; the rarer paths cost more
image than they save on the one request that first uses them (top logprobs +44 MiB for 44 ms, top-k/top-p
+58 MiB for 40 ms, penalties +33 MiB for 21 ms, the chosen token's logprob +21 MiB for 12 ms), so they
are left to that request. Prefills of several lengths cost under 1 MiB.
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
#: the sampler's common paths (greedy, and sampling at a temperature: OpenAI's default), decoded together
SAMPLING_PATHS = (SamplingParams(temperature=0.0), SamplingParams(temperature=0.8, seed=1))
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
    requests = 0
    if longest >= 1:  # else no prompt fits beside its tokens: nothing to warm
        asyncio.run(_serve(engine, lengths, min(8, longest)))
        requests = len(lengths) + len(SAMPLING_PATHS)
    if engine.blocks.num_used:
        raise RuntimeError(f"the warm-up left {engine.blocks.num_used} KV blocks in use")
    engine.reset_step_counts()
    engine.blocks.reset_prefix_cache()  # no request after it may find a throwaway prompt's blocks
    return WarmUp(requests, lengths, time.perf_counter() - started)


async def _serve(engine: "Engine", lengths: tuple[int, ...], together_length: int) -> None:
    vocab = engine.model_config.vocab_size
    for n in lengths:  # prompts that share no prefix, so each is computed whole
        await _drain(engine, _prompt(n, vocab, start=n), _throwaway(SAMPLING_PATHS[0]))
    await asyncio.gather(*(_drain(engine, _prompt(together_length, vocab, start=i), _throwaway(params))
                           for i, params in enumerate(SAMPLING_PATHS)))


def _throwaway(params: SamplingParams) -> SamplingParams:
    return dataclasses.replace(params, max_tokens=WARM_UP_TOKENS, ignore_eos=True)


def _prompt(length: int, vocab: int, start: int = 0) -> list[int]:
    # spread over the vocabulary, the same every bake: which tokens these are does not matter
    return [(7919 * i + 13) % vocab for i in range(start, start + length)]


async def _drain(engine: "Engine", prompt: list[int], params: SamplingParams) -> None:
    async for _ in engine.generate(prompt, params):
        pass
