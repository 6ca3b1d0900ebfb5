"""The trace's requests: Poisson arrivals, and prompt and output lengths drawn like ShareGPT's.

ShareGPT's conversations average 161 prompt and 338 output tokens (the figures Medusa and vLLM's
benchmarks use) with a long right tail; a log-normal with those means reproduces both, and lengths are
clipped so that every request fits the context.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

#: spread of the log-normals (the tail of ShareGPT's lengths: a few prompts of thousands of tokens)
LENGTH_SIGMA = 1.0


@dataclass(frozen=True)
class TraceRequest:
    arrival_s: float  # since the start of the trace
    prompt_tokens: int
    output_tokens: int


@dataclass(frozen=True)
class WorkloadShape:
    rate: float  # requests per second
    duration_s: float | None  # arrivals within this many seconds, or
    prompt_mean: float = 161.0
    output_mean: float = 338.0
    max_len: int = 4096
    seed: int = 0
    count: int | None = None  # ... this many arrivals, however long they take (one of the two is given)


def make_workload(shape: WorkloadShape) -> list[TraceRequest]:
    rng = random.Random(f"{shape.seed}:{shape.rate}")  # each rate its own stream, the same on every run
    requests, t = [], rng.expovariate(shape.rate)
    while (len(requests) < shape.count) if shape.count is not None else (t < shape.duration_s):
        prompt = _clip(_lognormal(rng, shape.prompt_mean), 1, shape.max_len // 2)
        output = _clip(_lognormal(rng, shape.output_mean), 1, shape.max_len - prompt)
        requests.append(TraceRequest(round(t, 6), prompt, output))
        t += rng.expovariate(shape.rate)
    return requests


def _lognormal(rng: random.Random, mean: float) -> float:
    # E[exp(N(mu, s^2))] = exp(mu + s^2 / 2): choose mu so the mean is `mean`
    return rng.lognormvariate(math.log(mean) - LENGTH_SIGMA ** 2 / 2, LENGTH_SIGMA)


def _clip(value: float, low: int, high: int) -> int:
    return max(low, min(high, round(value)))
