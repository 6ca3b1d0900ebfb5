"""Starting an instance that serves several models (MODEL=name=reference,...; docs/multi-model.md).

Each model's engine is built (the CPU phase: tokenizer, structure, weight plan) on every device its
placement gives it, and added to that device's ModelPool (runtime/pool); none is started yet. Then the
first model of the list is made resident on its first device, so the instance is ready with its weights
in place, as a lone model's is; every other model is made resident by its first request (a switch).

With SNAPSHOT_DIR, the engines may come from the instance's process snapshot (SNAPSHOT_DIR/process: a CRIU
image of a runtime that built them all, restored by the bootstrap before it listens; snapshots/restore.py),
and each model's materialised CUDA graphs (faas-build bakes them into SNAPSHOT_DIR/name, captured against
the model's KV cache in a pool) go to the pool with its engine, which rebuilds them at the model's first
start instead of capturing them.

Devices: on CUDA every GPU the process sees (CUDA_VISIBLE_DEVICES chooses them), each with its own pool and
engines (cuda:0, cuda:1, ...; a lone GPU is plain `cuda`); the host on CPU. POOL_CPU_DEVICES=N makes N host
pools that stand for N GPUs, which is how the placement policies (runtime/server/routing.py) run without a
GPU.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

from runtime.config import ConfigError, Settings
from runtime.logs import get_logger
from runtime.server.models import Placement, StartedModels
from runtime.server.routing import fixed_devices
from runtime.timeline import Timeline

if TYPE_CHECKING:
    from runtime.config import ModelRef
    from runtime.engine import Engine

log = get_logger("multi_model")


@dataclass(frozen=True)
class BuiltModels:
    """Every model's engines, built (the CPU phase) and not started: model -> pool device -> engine, in MODEL
    order and each model's placement order."""

    engines: dict[str, dict[str, "Engine"]]

    def placements(self) -> dict[str, list[str]]:
        return {name: list(engines) for name, engines in self.engines.items()}

    def first(self) -> "Engine":
        """The engine the start makes resident: the first model's, on its first device."""
        return next(iter(next(iter(self.engines.values())).values()))


def pool_devices(settings: Settings, device: str, gpus: int | None = None) -> list[str]:
    """The devices an instance pools: every visible GPU (GPUS of them; None: as many as CUDA counts), or the
    host once per POOL_CPU_DEVICES."""
    if device == "cpu":
        n = settings.pool_cpu_devices
        return ["cpu"] if n == 1 else [f"cpu:{i}" for i in range(n)]
    if gpus is None:
        import torch

        gpus = torch.cuda.device_count()
    return ["cuda"] if gpus == 1 else [f"cuda:{i}" for i in range(gpus)]


def engine_device(pool_device: str) -> str:
    """The device an engine of POOL_DEVICE runs on: the GPU it names, or the host for a simulated cpu:N."""
    return "cpu" if pool_device.startswith("cpu") else pool_device


def placements(settings: Settings, devices: list[str]) -> dict[str, list[str]]:
    """model name -> the devices it gets an engine on."""
    names = [m.name for m in settings.models]
    if settings.placement == "fixed":
        return {name: [device] for name, device in fixed_devices(names, devices).items()}
    return {name: list(devices) for name in names}


def planned_placements(settings: Settings) -> dict[str, list[str]]:
    """`placements` as the instance would make them here, decided without CUDA (the runtime a process snapshot
    freezes must not initialise it): the GPUs counted from CUDA_VISIBLE_DEVICES or the driver's list."""
    from snapshots.fingerprint import gpu_count, resolved_device

    device = resolved_device(settings)
    return placements(settings, pool_devices(settings, device, gpu_count() if device != "cpu" else None))


def build_models(settings: Settings, where: dict[str, list[str]],
                 build: Callable[[Settings, str], "Engine"]) -> BuiltModels:
    """Every model's engine on each device WHERE gives it (BUILD: a lone model's CPU phase, for its settings
    and the engine's device)."""
    return BuiltModels({model.name: {device: build(settings.for_model(model), engine_device(device))
                                     for device in where[model.name]} for model in settings.models})


def start_models(settings: Settings, timeline: Timeline,
                 build: Callable[[Settings, Timeline, str], "Engine"]) -> StartedModels:
    """Pool every model's engines per device, from the process snapshot if one was restored, else built here
    (BUILD: a lone model's CPU phase, for its settings and device); make the first model resident (blocking)."""
    import torch

    from runtime.launch import resolve_device
    from runtime.pool.errors import PoolError
    from runtime.pool.pool import ModelPool, device_budget

    device_kind = resolve_device(settings.device)
    devices = pool_devices(settings, device_kind)
    where = placements(settings, devices)
    skipped: dict[str, str] = {}
    built = _restored_models(settings, timeline, where, skipped)
    try:
        pools = {d: ModelPool(torch.device(engine_device(d)), device_budget(
            torch.device(engine_device(d)), settings.gpu_memory_utilization, settings.pool_memory_gb),
            settings.pool_eviction, proactive_kernels=settings.pool_kernels == "beside") for d in devices}
    except PoolError as exc:
        raise ConfigError(str(exc)) from None
    if built is None:
        built = build_models(settings, where, lambda per_model, device: build(per_model, timeline, device))
    engines: dict[str, list[Placement]] = {}
    unbaked: dict[str, str] = {}
    for model in settings.models:
        for device, engine in built.engines[model.name].items():
            graphs = _baked_graphs(model_settings(settings, model), timeline, unbaked)
            try:
                pools[device].add(model.name, engine, graphs)
            except PoolError as exc:
                raise ConfigError(f"{device}: {exc}") from None
            engines.setdefault(model.name, []).append(Placement(device, engine))
    first = settings.models[0].name
    device = where[first][0]
    report = pools[device].activate(first)  # the engine's start: its weights, KV cache and graphs stages
    log.info("serving %d models on %s (placement %s); %s resident on %s", len(engines), ", ".join(devices),
             settings.placement, first, device)
    if unbaked:
        skipped["materialized"] = "; ".join(f"{name}: {why}" for name, why in unbaked.items())
    path = "process" if "process" not in skipped else "cold" if unbaked else "materialized"
    return StartedModels(engines, pools, settings.placement, path, skipped, [(device, report)])


def _restored_models(settings: Settings, timeline: Timeline, where: dict[str, list[str]],
                     skipped: dict[str, str]) -> BuiltModels | None:
    """The engines the restored process snapshot holds, or None with why each CRIU path was not taken in
    SKIPPED. Engines built for other devices than the instance pools now are not used."""
    from runtime.start_paths import SkipPath

    if settings.restore not in ("auto", "gpu", "process"):
        skipped.update({kind: f"RESTORE={settings.restore}" for kind in ("gpu", "process")})
        return None
    from snapshots.restore import restored_models

    try:
        built = restored_models(timeline, skipped)
    except SkipPath as why:
        skipped["process"] = str(why)
        return None
    if built.placements() != where:
        skipped["process"] = (f"its engines are for {_placements_text(built.placements())}, this instance places "
                              f"{_placements_text(where)}")
        log.warning("restored process snapshot not used: %s", skipped["process"])
        return None
    return built


def _placements_text(where: dict[str, list[str]]) -> str:
    return "; ".join(f"{name} on {', '.join(devices)}" for name, devices in where.items())


def model_settings(settings: Settings, model: "ModelRef") -> Settings:
    """One model's settings in a several-model instance: as if served alone, its snapshots in SNAPSHOT_DIR/name
    (where faas-build bakes them)."""
    per_model = settings.for_model(model)
    if settings.snapshot_dir is None:
        return per_model
    return per_model.replace(snapshot_dir=settings.snapshot_dir / model.name)


def _baked_graphs(settings: Settings, timeline: Timeline, unbaked: dict[str, str]):
    """The model's materialised graphs (a restorer for the pool), or None with the reason in `unbaked`."""
    from runtime.start_paths import SkipPath

    if settings.snapshot_dir is None:
        unbaked[settings.served_model_name] = "SNAPSHOT_DIR is not set"
        return None
    from snapshots.restore import materialized_state

    try:
        return materialized_state(settings, timeline, pooled=True)[1]
    except SkipPath as why:
        unbaked[settings.served_model_name] = str(why)
    except Exception as exc:  # a damaged snapshot must not keep the model from starting cold
        log.exception("the materialized snapshot of %s is unusable", settings.served_model_name)
        unbaked[settings.served_model_name] = f"unusable: {type(exc).__name__}: {exc}"
    return None
