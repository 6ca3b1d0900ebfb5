"""A pool of server instances behind a router, and the scaler that grows and shrinks it.

Requests wait at the router until an instance has a free slot. When requests queue, the scaler starts a
new instance of the chosen mode (a real cold start: a new process), up to `max_instances`; an instance idle
for `idle_timeout_s` is retired. With no instance at all the first request starts one (scale from zero).
"""

from __future__ import annotations

import asyncio
import collections
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from runtime.bench import BenchError
from runtime.bench.instance import Instance
from runtime.logs import get_logger

log = get_logger("bench")


@dataclass(frozen=True)
class ScalePolicy:
    max_instances: int = 4
    slots: int = 16  # requests in flight per instance before more wait at the router
    queue_threshold: int = 4  # one more start per this many waiting requests
    idle_timeout_s: float = 30.0
    #: GPUs to spread instances over, round robin (CUDA_VISIBLE_DEVICES); empty: every instance sees all
    gpus: tuple[str, ...] = ()
    #: each instance the init of a pid namespace with its own /proc, as in a container (Instance.spawn)
    own_pid_namespaces: bool = False
    #: one SNAPSHOT_DIR per instance running at once; each start takes one no running or stopping instance holds
    snapshot_dirs: tuple[str, ...] = ()


@dataclass
class Member:
    instance: Instance
    index: int  # into InstancePool.starts
    snapshot_dir: str | None = None  # its own, from ScalePolicy.snapshot_dirs, given back once it has stopped
    ready: bool = False
    in_flight: int = 0
    idle_since: float = field(default_factory=time.monotonic)

    @property
    def url(self) -> str:
        return self.instance.url


@dataclass
class StartRecord:
    """One instance the scaler started."""

    spawn_to_ready_s: float | None
    restore_path: str | None
    retired: bool = False


class InstancePool:
    def __init__(self, mode: str, settings: dict[str, str], policy: ScalePolicy, client: httpx.AsyncClient,
                 log_dir: Path, timeout_s: float) -> None:
        self.mode, self.settings, self.policy = mode, settings, policy
        self._client, self._log_dir, self._timeout_s = client, log_dir, timeout_s
        self._members: list[Member] = []
        self._waiters: collections.deque[asyncio.Future[Member]] = collections.deque()
        self._bringing_up: set[asyncio.Task] = set()
        self._stopping: set[asyncio.Task] = set()
        self.starts: list[StartRecord] = []
        self.failure: BenchError | None = None
        self._free_snapshot_dirs = list(policy.snapshot_dirs)

    async def acquire(self) -> Member:
        """An instance with a free slot, waiting (and scaling) until there is one."""
        if self.failure:
            raise self.failure
        waiter = asyncio.get_running_loop().create_future()
        self._waiters.append(waiter)
        self._dispatch()
        self._scale_up()
        return await waiter

    def release(self, member: Member) -> None:
        member.in_flight -= 1
        if member.in_flight == 0:
            member.idle_since = time.monotonic()
        self._dispatch()

    async def run_scaler(self, period_s: float = 0.05) -> None:
        """Retire idle instances and start new ones while requests queue (run as a task; cancel to stop)."""
        while True:
            self._retire_idle()
            self._scale_up()
            await asyncio.sleep(period_s)

    async def close(self) -> None:
        for task in list(self._bringing_up):
            task.cancel()
        await asyncio.gather(*self._bringing_up, *self._stopping, return_exceptions=True)
        await asyncio.gather(*(self._stop(m) for m in self._members))
        self._members.clear()

    def _dispatch(self) -> None:
        while self._waiters:
            if self._waiters[0].done():  # its request was cancelled
                self._waiters.popleft()
                continue
            free = [m for m in self._members if m.ready and m.in_flight < self.policy.slots]
            if not free:
                return
            member = min(free, key=lambda m: m.in_flight)
            member.in_flight += 1
            self._waiters.popleft().set_result(member)

    def _scale_up(self) -> None:
        waiting = sum(not w.done() for w in self._waiters)
        starting = sum(not m.ready for m in self._members)
        if not waiting or len(self._members) >= self.policy.max_instances or self.failure:
            return
        if self.policy.snapshot_dirs and not self._free_snapshot_dirs:  # one is held by an instance still stopping
            return
        if not self._members or waiting > self.policy.queue_threshold * (starting + 1):
            self._spawn()

    def _spawn(self) -> None:
        index = len(self.starts)
        settings = self.settings
        if self.policy.gpus:
            settings = settings | {"CUDA_VISIBLE_DEVICES": self.policy.gpus[index % len(self.policy.gpus)]}
        snapshot_dir = self._free_snapshot_dirs.pop(0) if self.policy.snapshot_dirs else None
        if snapshot_dir:
            settings = settings | {"SNAPSHOT_DIR": snapshot_dir}
        instance = Instance.spawn(self.mode, settings, self._log_dir / f"{self.mode}-{index + 1}.log",
                                  self.policy.own_pid_namespaces)
        member = Member(instance, index, snapshot_dir)
        self._members.append(member)
        self.starts.append(StartRecord(None, None))
        log.info("trace: starting %s instance %d (%d waiting)", self.mode, index + 1, len(self._waiters))
        _track(self._bringing_up, self._bring_up(member))

    async def _bring_up(self, member: Member) -> None:
        instance, record = member.instance, self.starts[member.index]
        try:
            health = await instance.wait_ready(self._client, self._timeout_s)
            record.spawn_to_ready_s = round(instance.ready_at - instance.spawned_at, 6)
            record.restore_path = health.get("restore_path")
            instance.check_restore_path()
        except BenchError as exc:
            self._fail(exc)
            return
        member.ready = True
        member.idle_since = time.monotonic()
        self._dispatch()

    def _retire_idle(self) -> None:
        now = time.monotonic()
        for member in list(self._members):
            if member.ready and member.in_flight == 0 and now - member.idle_since > self.policy.idle_timeout_s:
                self._members.remove(member)
                self.starts[member.index].retired = True
                log.info("trace: retiring idle %s instance %d", self.mode, member.index + 1)
                _track(self._stopping, self._stop(member))

    async def _stop(self, member: Member) -> None:
        await member.instance.stop()
        if member.snapshot_dir:
            self._free_snapshot_dirs.append(member.snapshot_dir)

    def _fail(self, exc: BenchError) -> None:
        self.failure = exc
        while self._waiters:
            waiter = self._waiters.popleft()
            if not waiter.done():
                waiter.set_exception(exc)


def _track(tasks: set[asyncio.Task], work) -> None:
    task = asyncio.create_task(work)
    tasks.add(task)
    task.add_done_callback(tasks.discard)
