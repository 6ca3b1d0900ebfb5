"""`faas-bench switch`, the switch latency: in one instance serving every model, a request for B arriving
while A is active (A served the last request), timed to B's first token, with B in three states:

- retained: every byte of B still in the pool (B served a request before A, and nothing evicted it);
- partial: some of B's weight groups evicted (switch_partial.py reaches it in an instance of its own);
- evicted: none of B left.

Retained and evicted are reached by serving other models (each one request) until B's share in the pool, read
from /health, is in that state; a state the pool's eviction never produces (the cost model may keep a part of B
that other models never need) is reported as skipped with what happened. The evicted state is then probed
again in an instance with POOL_EVICTION=lru, which drops whole models (`eviction` says which policy got it).
Each probe also times B's request with B already active (no switch), so the switch's own cost is the
difference, and reads from /health where the pool's activation of B spent its time.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Awaitable, Callable, TypeVar

import httpx

from runtime.bench import BenchError
from runtime.bench.client import Prompt, stream_completion
from runtime.bench.instance import Instance
from runtime.bench.switch_models import BenchModel
from runtime.logs import get_logger

log = get_logger("bench")

STATES = ("retained", "partial", "evicted")
T = TypeVar("T")


@dataclass
class SwitchProbe:
    model: str  # B
    shape: str
    previous: str  # A, active when B's request arrived
    state: str  # the state asked for
    eviction: str = "cost"  # the instance's POOL_EVICTION
    status: str = "ok"  # or "skipped"
    reason: str | None = None
    retained_fraction: float | None = None  # of B's weights in the pool when its request arrived
    ttft_s: float | None = None  # B's request, sent -> first token, A active
    active_ttft_s: float | None = None  # the same request with B active: no switch
    switch_s: float | None = None  # the pool's activation of B (/health: last_switch_s) when it loaded bytes
    # of switch_s (/health: last_switch_evict_s, _map_s, _stream_s): making room (other models' memory given
    # back), backing B's missing groups, streaming them in verified
    evict_s: float | None = None
    map_s: float | None = None
    stream_s: float | None = None
    bytes_loaded: int = 0
    gib_per_s: float | None = None  # bytes_loaded / switch_s


class InstanceProbe:
    """Requests and /health reads against one running several-model instance."""

    def __init__(self, client: httpx.AsyncClient, url: str, prompt: Prompt, timeout_s: float,
                 max_tokens: int = 1) -> None:
        self.client, self.url, self.prompt, self.timeout_s = client, url, prompt, timeout_s
        self.max_tokens = max_tokens
        self.outputs: dict[str, str] = {}  # model -> the text of its last request

    async def request(self, model: str) -> float:
        """One greedy request for `model` (max_tokens, one by default); returns its TTFT."""
        timing = await stream_completion(self.client, self.url, self.prompt, self.max_tokens, self.timeout_s,
                                         every_token=True, model=model)
        if not timing.ok:
            raise BenchError(f"a request for {model} failed: {timing.error}")
        self.outputs[model] = timing.text
        return timing.first_token_at - timing.sent_at

    async def health(self) -> dict:
        return (await self.client.get(f"{self.url}/health", timeout=30)).json()

    async def pool_model(self, model: str) -> dict:
        """`model`'s entry of /health's pools on the device that holds most of it."""
        return (await self.pool_of(model))["models"][model]

    async def pool_of(self, model: str) -> dict:
        """/health's pool of the device that holds most of `model` (the device its request would go to)."""
        pools = [pool for pool in (await self.health())["pools"].values() if model in pool["models"]]
        return max(pools, key=lambda pool: pool["models"][model]["resident_bytes"])

    async def first_start(self, model: str) -> dict | None:
        """What `model`'s engine start spent (/health `first_start`), None while it never started."""
        starts = [m["first_start"] for m in self._entries(await self.health(), model) if m["first_start"]]
        return starts[0] if starts else None

    @staticmethod
    def _entries(health: dict, model: str) -> list[dict]:
        return [pool["models"][model] for pool in health["pools"].values() if model in pool["models"]]


async def in_instance(mode: str, settings: dict[str, str], prompt: Prompt, log_path: Path, timeout_s: float,
                      work: Callable[[InstanceProbe], Awaitable[T]]) -> T:
    """WORK against one instance started on restore path MODE with SETTINGS, stopped after it."""
    async with httpx.AsyncClient() as client:
        instance = Instance.spawn(mode, settings, log_path)
        try:
            await instance.wait_ready(client, timeout_s)
            return await work(InstanceProbe(client, instance.url, prompt, timeout_s))
        finally:
            await instance.stop()


async def probe(instance: InstanceProbe, b: BenchModel, a: BenchModel, others: list[BenchModel],
                state: str) -> SwitchProbe:
    result = SwitchProbe(b.name, b.shape, a.name, state)
    await instance.request(b.name)  # B resident (its engine started, the first time)
    result.active_ttft_s = round(await instance.request(b.name), 6)
    fraction = 1.0
    for step in range(2 * len(others) + 1):
        await instance.request(a.name)
        entry = await instance.pool_model(b.name)
        fraction = entry["resident_bytes"] / entry["total_bytes"]
        got = classify(fraction)
        if got == state:
            return await measure(instance, result, fraction, entry)
        if STATES.index(got) > STATES.index(state):
            result.status, result.reason = "skipped", (
                f"{b.name} was {got} ({fraction:.0%} retained) already after {a.name}" if step == 0 else
                f"{b.name} went from {STATES[STATES.index(state) - 1] if state != 'retained' else 'retained'} to "
                f"{got} ({fraction:.0%} retained) when {others[(step - 1) % len(others)].name} was served")
            return result
        if others:
            await instance.request(others[step % len(others)].name)
    result.status, result.reason = "skipped", (
        f"{b.name} stayed {classify(fraction)} ({fraction:.0%} retained) after every other model served a "
        f"request twice: the pool keeps that much of it")
    return result


def classify(fraction: float) -> str:
    return "retained" if fraction >= 1.0 else ("evicted" if fraction <= 0.0 else "partial")


async def measure(instance: InstanceProbe, result: SwitchProbe, fraction: float, before: dict) -> SwitchProbe:
    """B's request, with FRACTION of B retained (BEFORE: B's pool entry): its TTFT and, if it loaded bytes,
    the pool's activation of B."""
    result.retained_fraction = round(fraction, 4)
    log.info("switch: %s -> %s with %.0f%% of %s retained", result.previous, result.model, fraction * 100,
             result.model)
    result.ttft_s = round(await instance.request(result.model), 6)
    after = await instance.pool_model(result.model)
    if after["loads"] > before["loads"]:
        result.switch_s = round(after["last_switch_s"], 6)
        result.evict_s, result.map_s, result.stream_s = (round(after[f"last_switch_{part}_s"], 6)
                                                         for part in ("evict", "map", "stream"))
        result.bytes_loaded = before["total_bytes"] - before["resident_bytes"]
        if result.switch_s > 0:
            result.gib_per_s = round(result.bytes_loaded / result.switch_s / 2**30, 3)
    log.info("switch: %s's first token %.3f s after its request (%.3f s with it active), %.1f MiB loaded in %s s "
             "(evict %s s, map %s s, stream %s s)", result.model, result.ttft_s, result.active_ttft_s,
             result.bytes_loaded / 2**20, *("-" if v is None else v for v in
                                           (result.switch_s, result.evict_s, result.map_s, result.stream_s)))
    return result


def probe_targets(models: list[BenchModel]) -> list[tuple[BenchModel, BenchModel, list[BenchModel]]]:
    """(B, A, the others) for the first model of each shape: A is the smallest other model (its switch
    evicts least of B by itself), the others are what evicts B."""
    targets, seen = [], set()
    for b in models:
        if b.shape in seen:
            continue
        seen.add(b.shape)
        rest = [m for m in models if m is not b]
        if not rest:
            raise BenchError("the switch benchmark needs at least two models")
        a = min(rest, key=lambda m: m.nbytes)
        others = sorted((m for m in rest if m is not a), key=lambda m: -m.nbytes)
        targets.append((b, a, others))
    return targets
