"""Several models in one instance, as the server sees them (MODEL=name=reference,...; docs/multi-model.md).

Each model has an engine on one or more devices, each device one ModelPool (runtime/pool). A request's
`model` picks a `ModelView`, which handlers use exactly as the lone model's EngineView; its generate()
picks the device by the placement policy (runtime/server/routing.py) and passes the device's DeviceSlot,
which makes the model resident before the engine sees the request (runtime/server/switching.py).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, AsyncIterator

from runtime.engine.outputs import EngineStats, RequestOutput
from runtime.engine.sampling_params import SamplingParams
from runtime.server.engine_view import EngineView
from runtime.server.errors import APIError, bad_request
from runtime.server.routing import NoDevice, RoundRobin, choose_affinity
from runtime.server.switching import DeviceSlot
from runtime.timeline import Timeline

if TYPE_CHECKING:
    from runtime.engine import Engine
    from runtime.engine.tokenizer import Tokenizer
    from runtime.pool.pool import ModelPool, SwitchReport
    from runtime.server.metrics import ServerMetrics


@dataclass(frozen=True)
class Placement:
    """An engine of a model on one device (built, added to that device's pool)."""

    device: str
    engine: "Engine"


@dataclass(frozen=True)
class StartedModels:
    """What the start of a several-model instance hands the server."""

    placements: dict[str, list[Placement]]  # model -> its engines, in MODEL order
    pools: dict[str, "ModelPool"]  # device -> its pool
    policy: str  # PLACEMENT: affinity, round-robin or fixed
    restore_path: str
    skipped: dict[str, str] = field(default_factory=dict)
    #: the activations the start made (device, its report), counted in the metrics like any load
    started: list[tuple[str, "SwitchReport"]] = field(default_factory=list)
    restore_order: dict[str, Any] = field(default_factory=dict)  # a several-model start tries no restore path


class _SlotGate:
    def __init__(self, slot: DeviceSlot, model: str) -> None:
        self.slot = slot
        self.model = model

    async def enter(self) -> None:
        await self.slot.enter(self.model)

    def leave(self, seconds: float) -> None:
        self.slot.leave(self.model, seconds)


class ModelView:
    """One of several models: what EngineView offers handlers, over the model's engines on its devices."""

    def __init__(self, name: str, placements: list[tuple[DeviceSlot, EngineView]], policy: str,
                 round_robin: RoundRobin) -> None:
        self.model_name = name
        self.placements = placements
        self._policy = policy
        self._round_robin = round_robin

    @property
    def devices(self) -> list[str]:
        return [slot.device for slot, _ in self.placements]

    @property
    def max_model_len(self) -> int:
        return self.placements[0][1].max_model_len

    @property
    def tokenizer(self) -> "Tokenizer":
        return self.placements[0][1].tokenizer

    def stats(self) -> EngineStats:
        return sum_stats(view.stats() for _, view in self.placements)

    async def abort(self, request_id: str) -> None:
        for _, view in self.placements:
            if view.engine.ready:
                await view.abort(request_id)

    def generate(self, prompt: str | list[int], params: SamplingParams,
                 request_id: str | None = None) -> AsyncIterator[RequestOutput]:
        return self.placements[self.choose_device()][1].generate(prompt, params, request_id)

    def choose_device(self) -> int:
        """Index of the placement the next request runs on."""
        if len(self.placements) == 1:
            return 0
        loads = [slot.load(self.model_name) for slot, _ in self.placements]
        try:
            if self._policy == "round-robin":
                return self._round_robin.choose(self.model_name, loads)
            return choose_affinity(loads, [slot.load_rate for slot, _ in self.placements])
        except NoDevice as exc:
            raise APIError(503, f"model `{self.model_name}`: {exc}", code="model_unavailable",
                           type="server_error") from None


def sum_stats(all_stats: Any) -> EngineStats:
    """The instance's figures: each field summed over the engines."""
    totals = [0] * len(dataclasses.fields(EngineStats))
    for s in all_stats:
        totals = [t + v for t, v in zip(totals, dataclasses.astuple(s))]
    return EngineStats(*totals)


class ServedModels:
    """The models of a several-model instance, by name, and the device slots they run through."""

    def __init__(self, started: StartedModels, metrics: "ServerMetrics", timeline: Timeline) -> None:
        self.policy = started.policy
        self.slots = {device: DeviceSlot(device, pool, metrics, timeline) for device, pool in started.pools.items()}
        round_robin = RoundRobin()
        self.views = {
            name: ModelView(name, [(self.slots[p.device],
                                    EngineView(p.engine, metrics, timeline, _SlotGate(self.slots[p.device], name)))
                                   for p in placements], started.policy, round_robin)
            for name, placements in started.placements.items()}
        for device, report in started.started:
            self.slots[device].count_load(report.model, report)

    @property
    def names(self) -> list[str]:
        return list(self.views)

    def view(self, model: Any) -> ModelView:
        """The model a request names: 400 when it names none (several models: no default), 404 when it is
        not served."""
        if model is None:
            raise bad_request(f"'model' is required: this server serves several models ({', '.join(self.views)})",
                              "model")
        if not isinstance(model, str):
            raise bad_request(f"'model' must be a string, got {model!r}", "model")
        view = self.views.get(model)
        if view is None:
            raise APIError(404, f"The model `{model}` does not exist. This server serves "
                           f"{', '.join(f'`{n}`' for n in self.views)}.", param="model", code="model_not_found")
        return view

    def stats(self) -> EngineStats:
        return sum_stats(view.stats() for view in self.views.values())

    def cut_requests(self, reason: str) -> None:
        """The drain's grace period is over: every request still in any engine ends."""
        for view in self.views.values():
            for _, engine_view in view.placements:
                if engine_view.engine.ready:
                    engine_view.cut_requests(reason)

    def shutdown(self) -> None:
        for slot in self.slots.values():
            slot.shutdown()
            slot.pool.shutdown()  # stops its started engines and gives their memory back
