"""One device's ModelPool as the server drives it: a request is admitted once its model is resident there.

A request for a model that is running on the device joins it at once. Any other waits its turn (one switch
at a time per device, in arrival order, so a busy model cannot starve a waiting one): the pool makes its
model resident on a worker thread (`ModelPool.activate`), evicting retained weights of models with no
request in flight; the requests for the same model that arrived meanwhile find it resident when their turn
comes, so they wait for that one switch and make none. A model is held in the pool from its first request
in flight to its last. A switch that cannot fit while other models' requests run waits for one of them to
finish and tries again; one that cannot fit on an idle device is refused (503).

Each switch that moved bytes is timed into the switch histogram, logged, and recorded on the timeline as
the `model_switch` stage (the latest one: the timeline is the instance's start, not a log), with where the
pool's part of it went (`evict_s`, `map_s`, `stream_s`: SwitchReport).
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING

from runtime import timeline as stages
from runtime.logs import get_logger
from runtime.server.errors import APIError
from runtime.server.routing import DeviceLoad
from runtime.timeline import Timeline

if TYPE_CHECKING:
    from runtime.pool.pool import ModelPool, SwitchReport
    from runtime.server.metrics import ServerMetrics

log = get_logger("switch")

#: the load rate assumed before the first switch on a device has been measured (bytes/s)
INITIAL_LOAD_RATE = {"cuda": 10 << 30, "cpu": 1 << 30}
#: the service time assumed for a request before one has been measured (seconds)
INITIAL_REQUEST_S = 1.0
_EWMA = 0.2  # weight of the newest measurement in the running load rate and request time


class DeviceSlot:
    def __init__(self, device: str, pool: "ModelPool", metrics: "ServerMetrics", timeline: Timeline) -> None:
        self.device = device
        self.pool = pool
        self._metrics = metrics
        self._timeline = timeline
        self._turn = asyncio.Lock()  # FIFO: switches in arrival order
        self._in_flight: Counter[str] = Counter()
        self._released: asyncio.Event | None = None  # set by the next release, for a switch short of room
        self._releases = 0
        self._queued_bytes = 0       # missing bytes of the switches waiting their turn
        self._executor = ThreadPoolExecutor(1, thread_name_prefix=f"switch-{device}")
        self.load_rate = float(INITIAL_LOAD_RATE.get(device.split(":")[0], INITIAL_LOAD_RATE["cpu"]))
        self.request_s = INITIAL_REQUEST_S

    # -- admission (event loop) ---------------------------------------------------------------------

    async def enter(self, model: str) -> None:
        """Return once `model` is resident and held for one more request; raises APIError 503 if it cannot
        be made resident on this device."""
        self.pool.note_request(model, time.time())
        if self._in_flight[model] and not self._turn.locked():
            self._in_flight[model] += 1
            return
        missing = self.missing_bytes(model)
        self._queued_bytes += missing
        try:
            async with self._turn:
                self._queued_bytes -= missing
                missing = 0
                await self._make_resident(model)
                self._in_flight[model] += 1
        finally:
            self._queued_bytes -= missing

    def leave(self, model: str, seconds: float) -> None:
        """A request of `model` finished (or failed) after `seconds` in the engine."""
        self.request_s += _EWMA * (seconds - self.request_s)
        self._in_flight[model] -= 1
        if self._in_flight[model] == 0:
            del self._in_flight[model]
            self._executor.submit(self.pool.release, model)
            self._releases += 1
            if self._released is not None:  # a waiting switch retries, on the same thread, after the release
                self._released.set()

    async def _make_resident(self, model: str) -> None:
        loop = asyncio.get_running_loop()
        while True:
            hold = _Hold(model) if not self._in_flight[model] else None  # held from its first request in flight
            releases = self._releases
            started = time.time()
            work = loop.run_in_executor(self._executor, self._activate, model, hold)
            try:
                report = await asyncio.shield(work)
            except asyncio.CancelledError:  # the client left; the switch goes on and its hold is undone after
                if hold is not None:
                    self._executor.submit(self._undo, hold)
                raise
            except Exception as exc:
                # A release since this try began was queued on the worker thread after it, so the retry sees
                # it: the request that held the room may have finished while the refusal came back.
                released = self._releases != releases
                if not released and not self._others_in_flight(model):
                    log.exception("%s: model %s cannot be made resident", self.device, model)
                    raise APIError(503, f"model `{model}` cannot be made resident on {self.device}: {exc}",
                                   code="model_unavailable", type="server_error") from None
                # room is held by other models' requests: the next one to finish may free it
                if not released:
                    self._released = asyncio.Event()
                    await self._released.wait()
                continue
            self._switched(model, report, started, time.time())
            return

    # On the slot's one worker thread, so the pool sees this device's holds, switches and releases in order.
    def _activate(self, model: str, hold: "_Hold | None") -> "SwitchReport":
        if hold is not None:
            self.pool.hold(model)
            hold.held = True
        try:
            return self.pool.activate(model)
        except BaseException:
            self._undo(hold)
            raise

    def _undo(self, hold: "_Hold | None") -> None:
        if hold is not None and hold.held:
            hold.held = False
            self.pool.release(hold.model)

    def _others_in_flight(self, model: str) -> bool:
        return any(n for name, n in self._in_flight.items() if name != model)

    def _switched(self, model: str, report: "SwitchReport", start: float, end: float) -> None:
        loaded = report.bytes_loaded
        if not loaded and not report.first_start:
            return  # it was resident already
        seconds = end - start
        self.count_load(model, report)
        if loaded and seconds > 0:
            self.load_rate += _EWMA * (loaded / seconds - self.load_rate)
        self._metrics.switch_seconds.labels(model, self.device).observe(seconds)
        self._timeline.record(stages.MODEL_SWITCH, start, end, replace=True, model=model, device=self.device,
                              bytes=loaded, evicted_bytes=report.bytes_evicted, evict_s=round(report.evict_s, 6),
                              map_s=round(report.map_s, 6), stream_s=round(report.stream_s, 6))
        log.info("switched %s to %s in %.3f s: %.1f MiB loaded, %.1f MiB of other models evicted (evict %.3f s, "
                 "map %.3f s, stream %.3f s)", self.device, model, seconds, loaded / (1 << 20),
                 report.bytes_evicted / (1 << 20), report.evict_s, report.map_s, report.stream_s)

    def count_load(self, model: str, report: "SwitchReport") -> None:
        self._metrics.loaded_bytes.labels(model, self.device).inc(report.bytes_loaded)

    # -- what routing sees --------------------------------------------------------------------------

    def missing_bytes(self, model: str) -> int:
        m = self.pool.stats().models[model]
        return max(0, m.total_bytes - m.resident_bytes)

    def running(self, model: str) -> bool:
        return bool(self._in_flight[model])

    def load(self, model: str) -> DeviceLoad:
        stats = self.pool.stats()
        m = stats.models[model]
        held = m.resident_bytes
        running = self.running(model) and not self._turn.locked()
        queued_s = self._queued_bytes / self.load_rate
        if not running and self._others_in_flight(model) and m.total_bytes - held > stats.free_bytes:
            queued_s += self.request_s  # room comes back when a running request finishes
        return DeviceLoad(self.device, m.total_bytes, held, queued_s, running, m.total_bytes <= stats.budget_bytes,
                          stats.free_bytes, stats.used_bytes)

    def shutdown(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)


class _Hold:
    """Whether a switch's hold on its model is in place (undone if the request goes away mid-switch)."""

    def __init__(self, model: str) -> None:
        self.model = model
        self.held = False
