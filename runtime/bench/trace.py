"""`faas-bench trace`, one (mode, rate): replay the workload against a fresh, empty pool and time each
request's TTFT from its arrival (so waiting for an instance to start counts, as it does for a user)."""

from __future__ import annotations

import asyncio
import random
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import httpx
import numpy

from runtime.bench import BenchError
from runtime.bench.client import RequestTiming, stream_completion
from runtime.bench.instance import ModeUnavailable
from runtime.bench.pool import InstancePool, ScalePolicy, StartRecord
from runtime.bench.prompt import PromptMaker
from runtime.bench.workload import TraceRequest

#: request errors kept in the JSON (the count is always complete)
_ERRORS_KEPT = 5


@dataclass
class TracePoint:
    mode: str
    rate: float
    status: Literal["ok", "skipped", "failed"] = "ok"
    reason: str | None = None
    requests: int = 0
    completed: int = 0
    errors: list[str] = field(default_factory=list)
    error_count: int = 0
    ttft_p50_s: float | None = None
    ttft_p99_s: float | None = None
    ttft_mean_s: float | None = None
    #: inter-token latency: the gaps between one token's chunk and the next, of every completed request, pooled
    itl_p50_s: float | None = None
    itl_p99_s: float | None = None
    itl_mean_s: float | None = None
    throughput_rps: float | None = None
    output_tokens_per_s: float | None = None
    instances: list[StartRecord] = field(default_factory=list)
    #: every completed request's TTFT, in arrival order (for the CDF)
    ttfts_s: list[float] = field(default_factory=list)


async def run_trace_point(mode: str, rate: float, workload: list[TraceRequest], prompts: PromptMaker,
                          settings: dict[str, str], policy: ScalePolicy, log_dir: Path, timeout_s: float,
                          seed: int) -> TracePoint:
    point = TracePoint(mode, rate, requests=len(workload))
    rng = random.Random(seed)
    limits = httpx.Limits(max_connections=policy.slots * policy.max_instances + 8)
    async with httpx.AsyncClient(limits=limits) as client:
        pool = InstancePool(mode, settings, policy, client, log_dir, timeout_s)
        scaler = asyncio.create_task(pool.run_scaler())
        start = time.time()
        try:
            sends = []
            for request in workload:
                await asyncio.sleep(max(0.0, start + request.arrival_s - time.time()))
                if pool.failure:  # the mode cannot run here: the rest of the trace would only fail
                    break
                prompt = prompts.prompt(request.prompt_tokens, rng)
                sends.append(asyncio.create_task(_send(pool, client, prompt, request.output_tokens, timeout_s)))
            sent = await asyncio.gather(*sends)
        finally:
            scaler.cancel()
            await pool.close()
    point.instances = pool.starts
    if isinstance(pool.failure, ModeUnavailable):
        point.status, point.reason = "skipped", str(pool.failure)
    elif pool.failure is not None:
        point.status, point.reason = "failed", str(pool.failure)
    else:
        _summarise(point, sent, start)
    return point


async def _send(pool: InstancePool, client: httpx.AsyncClient, prompt, max_tokens: int,
                timeout_s: float) -> tuple[float, RequestTiming]:
    """(arrival time, timing): TTFT counts from the arrival, so time spent waiting for an instance counts."""
    arrived = time.time()
    try:
        member = await pool.acquire()
    except BenchError as exc:
        return arrived, RequestTiming(sent_at=arrived, finished_at=time.time(), error=str(exc))
    try:
        return arrived, await stream_completion(client, member.url, prompt, max_tokens, timeout_s, every_token=True)
    finally:
        pool.release(member)


def count_outcomes(point, sent: list[tuple[float, RequestTiming]]) -> list[tuple[float, RequestTiming]]:
    """Record on POINT (a trace or multi-model trace point) how many requests completed and the first errors;
    a point where none completed is marked failed. Returns the completed (arrival, timing) pairs."""
    done = [(arrived, t) for arrived, t in sent if t.ok]
    failed = [t for _, t in sent if not t.ok]
    point.completed, point.error_count = len(done), len(failed)
    point.errors = [t.error or "no token" for t in failed[:_ERRORS_KEPT]]
    if not done:
        point.status, point.reason = "failed", f"no request completed ({point.errors[:1]})"
    return done


def record_ttfts(point, done: list[tuple[float, RequestTiming]]) -> None:
    """Time to first token, from arrival, of every completed request, with its median, p99 and mean."""
    ttfts = [t.first_token_at - arrived for arrived, t in done]
    point.ttfts_s = [round(x, 6) for x in ttfts]
    point.ttft_p50_s = round(float(numpy.percentile(ttfts, 50)), 6)
    point.ttft_p99_s = round(float(numpy.percentile(ttfts, 99)), 6)
    point.ttft_mean_s = round(float(numpy.mean(ttfts)), 6)


def record_itls(point, done: list[tuple[float, RequestTiming]]) -> None:
    """Inter-token latency: every gap between consecutive tokens of a completed request, all requests pooled
    (a request of one token adds none), with its median, p99 and mean; none when no request had two tokens."""
    gaps = numpy.concatenate([numpy.diff(t.token_times) for _, t in done] or [numpy.empty(0)])
    if not gaps.size:
        return
    point.itl_p50_s = round(float(numpy.percentile(gaps, 50)), 6)
    point.itl_p99_s = round(float(numpy.percentile(gaps, 99)), 6)
    point.itl_mean_s = round(float(numpy.mean(gaps)), 6)


def _summarise(point: TracePoint, sent: list[tuple[float, RequestTiming]], start: float) -> None:
    done = count_outcomes(point, sent)
    if not done:
        return
    record_ttfts(point, done)
    record_itls(point, done)
    span = max(t.finished_at for _, t in done) - start
    point.throughput_rps = round(len(done) / span, 6)
    point.output_tokens_per_s = round(sum(t.completion_tokens for _, t in done) / span, 3)
