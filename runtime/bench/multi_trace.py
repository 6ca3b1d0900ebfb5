"""`faas-bench switch`, the multi-model trace: Poisson arrivals with ShareGPT-like lengths (workload.py),
each request for a model drawn by Zipf popularity, replayed against

- pool: one instance serving every model from one memory pool (POOL_EVICTION=cost, Tangram's cost model);
- lru: the same instance evicting whole models, least recently used first (POOL_EVICTION=lru);
- per-model: one instance per model, started on its first request (a real cold start) and retired when
  idle (scale to zero), at most as many alive at once as fit the same memory;
- with several devices, the pool once per PLACEMENT (affinity, round-robin, fixed).

TTFT counts from the request's arrival, so waiting for a switch or for an instance to start counts.
"""

from __future__ import annotations

import asyncio
import random
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
from runtime.bench import BenchError
from runtime.bench.client import RequestTiming, stream_completion
from runtime.bench.device_usage import DeviceUsage, UsageSampler, physical_gpus, read_pool_counts
from runtime.bench.instance import Instance
from runtime.bench.prompt import PromptMaker
from runtime.bench.switch_models import BenchModel
from runtime.bench.trace import count_outcomes, record_ttfts
from runtime.bench.workload import TraceRequest
from runtime.logs import get_logger

log = get_logger("bench")



@dataclass
class SystemPoint:
    system: str
    rate: float
    status: str = "ok"  # or "failed"
    reason: str | None = None
    requests: int = 0
    completed: int = 0
    error_count: int = 0
    errors: list[str] = field(default_factory=list)
    ttft_p50_s: float | None = None
    ttft_p99_s: float | None = None
    ttft_mean_s: float | None = None
    switches: int = 0  # pool: times a model was made resident for a request; per-model: instance starts
    bytes_streamed: int = 0  # weight bytes loaded, starts included
    devices: dict[str, DeviceUsage] = field(default_factory=dict)  # pool: per device (runtime/bench/device_usage.py)
    ttfts_s: list[float] = field(default_factory=list)


def zipf_models(models: list[BenchModel], n: int, s: float, seed: int) -> list[BenchModel]:
    """`n` draws: the i-th model of the list with weight 1 / (i + 1)^s."""
    rng = random.Random(f"zipf:{seed}")
    weights = [1.0 / (i + 1) ** s for i in range(len(models))]
    return rng.choices(models, weights, k=n)


async def replay(system: str, rate: float, workload: list[TraceRequest], picks: list[BenchModel],
                 prompts: PromptMaker, send) -> tuple[SystemPoint, list[tuple[float, RequestTiming]]]:
    """Send each request at its arrival through `send(model, prompt, max_tokens)`; logs progress."""
    point = SystemPoint(system, rate, requests=len(workload))
    rng = random.Random(0)
    start = time.time()
    tasks, step = [], max(1, len(workload) // 10)
    for i, (request, model) in enumerate(zip(workload, picks)):
        await asyncio.sleep(max(0.0, start + request.arrival_s - time.time()))
        prompt = prompts.prompt(request.prompt_tokens, rng)
        tasks.append(asyncio.create_task(_timed(send, model, prompt, request.output_tokens)))
        if (i + 1) % step == 0:
            log.info("trace %s at %g/s: %d/%d requests sent", system, rate, i + 1, len(workload))
    return point, await asyncio.gather(*tasks)


async def _timed(send, model: BenchModel, prompt, max_tokens: int) -> tuple[float, RequestTiming]:
    arrived = time.time()
    try:
        return arrived, await send(model, prompt, max_tokens)
    except BenchError as exc:
        return arrived, RequestTiming(sent_at=arrived, finished_at=time.time(), error=str(exc))


def summarise(point: SystemPoint, sent: list[tuple[float, RequestTiming]]) -> SystemPoint:
    done = count_outcomes(point, sent)
    if done:
        record_ttfts(point, done)
    return point


# -- one instance, every model ----------------------------------------------------------------------------

async def run_pool(system: str, rate: float, workload: list[TraceRequest], picks: list[BenchModel],
                   prompts: PromptMaker, settings: dict[str, str], log_dir: Path, timeout_s: float) -> SystemPoint:
    async with httpx.AsyncClient(limits=httpx.Limits(max_connections=256)) as client:
        instance = Instance.spawn("cold", settings, log_dir / f"{system}-{rate:g}.log")
        sampler = None
        try:
            await instance.wait_ready(client, timeout_s)
            baseline = await read_pool_counts(client, instance.url)
            sampler = UsageSampler(client, instance.url,
                                   physical_gpus(settings.get("CUDA_VISIBLE_DEVICES"), list(baseline.devices)))
            sampler.start()

            async def send(model: BenchModel, prompt, max_tokens: int) -> RequestTiming:
                return await stream_completion(client, instance.url, prompt, max_tokens, timeout_s,
                                               every_token=True, model=model.name)

            point, sent = await replay(system, rate, workload, picks, prompts, send)
            counts = await read_pool_counts(client, instance.url)
        finally:
            if sampler is not None:
                await sampler.stop()
            await instance.stop()
    sampler.apply(counts)
    for device, usage in counts.devices.items():
        usage.switches -= baseline.devices.get(device, DeviceUsage()).switches
    point.switches = counts.switches
    point.bytes_streamed = counts.bytes_streamed  # the first model's start included, as each per-model start is
    point.devices = counts.devices
    return summarise(point, sent)


# -- one instance per model, scaled to zero ----------------------------------------------------------------

class Fleet:
    """Per model at most one instance, started by its first request and retired after `idle_s` without
    one; at most `capacity` alive at once: a start beyond that first retires the least recently used idle
    instance, or waits for one to become idle. With GPUS (indices), each start goes to the GPU with the fewest
    instances alive (its CUDA_VISIBLE_DEVICES)."""

    def __init__(self, settings: dict[str, dict[str, str]], capacity: int, idle_s: float, client: httpx.AsyncClient,
                 log_dir: Path, timeout_s: float, gpus: tuple[str, ...] = ()) -> None:
        self.settings, self.capacity, self.idle_s = settings, capacity, idle_s
        self.client, self.log_dir, self.timeout_s = client, log_dir, timeout_s
        self.gpus = gpus
        self.gpu_of: dict[str, str] = {}
        self.alive: dict[str, Instance] = {}
        self.ready: dict[str, asyncio.Future] = {}
        self.in_flight: dict[str, int] = {}
        self.last_used: dict[str, float] = {}
        self.starts: list[str] = []
        self._changed = asyncio.Condition()

    async def acquire(self, model: str) -> Instance:
        async with self._changed:
            while model not in self.ready:
                if len(self.ready) < self.capacity or await self._retire_idle():
                    self.ready[model] = asyncio.ensure_future(self._start(model))
                    break
                await self._changed.wait()
            future = self.ready[model]
            self.in_flight[model] = self.in_flight.get(model, 0) + 1
        try:
            return await asyncio.shield(future)
        except BaseException:
            await self.release(model)
            raise

    async def release(self, model: str) -> None:
        async with self._changed:
            self.in_flight[model] -= 1
            self.last_used[model] = time.monotonic()
            self._changed.notify_all()

    async def _start(self, model: str) -> Instance:
        self.starts.append(model)
        settings = self.settings[model]
        if self.gpus:
            alive = [self.gpu_of[m] for m in self.alive]
            self.gpu_of[model] = min(self.gpus, key=alive.count)
            settings = {**settings, "CUDA_VISIBLE_DEVICES": self.gpu_of[model]}
        instance = Instance.spawn("cold", settings, self.log_dir / f"per-model-{len(self.starts)}.log")
        self.alive[model] = instance
        await instance.wait_ready(self.client, self.timeout_s)
        return instance

    async def _retire_idle(self, older_than: float = 0.0) -> bool:
        """Retire the least recently used idle instance (idle at least `older_than` s); True if one was."""
        now = time.monotonic()
        idle = [m for m, f in self.ready.items() if f.done() and not self.in_flight.get(m)
                and now - self.last_used.get(m, now) >= older_than]
        if not idle:
            return False
        victim = min(idle, key=lambda m: self.last_used.get(m, 0.0))
        del self.ready[victim]
        await self.alive.pop(victim).stop()
        return True

    async def scale_to_zero(self) -> None:
        while True:
            await asyncio.sleep(min(1.0, self.idle_s / 4))
            async with self._changed:
                while await self._retire_idle(self.idle_s):
                    pass
                self._changed.notify_all()

    async def close(self) -> None:
        await asyncio.gather(*(instance.stop() for instance in self.alive.values()))


async def run_per_model(rate: float, workload: list[TraceRequest], picks: list[BenchModel], prompts: PromptMaker,
                        settings: dict[str, dict[str, str]], capacity: int, idle_s: float, log_dir: Path,
                        timeout_s: float, gpus: tuple[str, ...] = ()) -> SystemPoint:
    async with httpx.AsyncClient(limits=httpx.Limits(max_connections=256)) as client:
        fleet = Fleet(settings, capacity, idle_s, client, log_dir, timeout_s, gpus)
        scaler = asyncio.create_task(fleet.scale_to_zero())

        async def send(model: BenchModel, prompt, max_tokens: int) -> RequestTiming:
            instance = await fleet.acquire(model.name)
            try:
                return await stream_completion(client, instance.url, prompt, max_tokens, timeout_s, every_token=True)
            finally:
                await fleet.release(model.name)

        try:
            point, sent = await replay("per-model", rate, workload, picks, prompts, send)
        finally:
            scaler.cancel()
            await fleet.close()
    sizes = {m.name: m.nbytes for m in picks}
    point.switches = len(fleet.starts)
    point.bytes_streamed = sum(sizes[m] for m in fleet.starts)
    return summarise(point, sent)
