"""Starting an instance that serves several models (MODEL=name=reference,...; docs/multi-model.md).

Each model's engine is built (the CPU phase: tokenizer, structure, weight plan) on every device its
placement gives it, and added to that device's ModelPool (runtime/pool); none is started yet. Then the
first model of the list is made resident on its first device, so the instance is ready with its weights
in place, as a lone model's is; every other model is made resident by its first request (a switch).

With SNAPSHOT_DIR, each model's materialised CUDA graphs (faas-build bakes them into SNAPSHOT_DIR/name,
captured against the model's KV cache in a pool) go to the pool with its engine, which rebuilds them at the
model's first start instead of capturing them; the CRIU paths are not taken (their image holds one model's
process).

Devices: on CUDA every GPU the process sees (CUDA_VISIBLE_DEVICES chooses them), each with its own pool and
engines (cuda:0, cuda:1, ...; a lone GPU is plain `cuda`); the host on CPU. POOL_CPU_DEVICES=N makes N host
pools that stand for N GPUs, which is how the placement policies (runtime/server/routing.py) run without a
GPU.
"""

from __future__ import annotations

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


def pool_devices(settings: Settings, device: str) -> list[str]:
    """The devices an instance pools: every visible GPU, or the host once per POOL_CPU_DEVICES."""
    if device == "cpu":
        n = settings.pool_cpu_devices
        return ["cpu"] if n == 1 else [f"cpu:{i}" for i in range(n)]
    import torch

    n = torch.cuda.device_count()
    return ["cuda"] if n == 1 else [f"cuda:{i}" for i in range(n)]


def engine_device(pool_device: str) -> str:
    """The device an engine of POOL_DEVICE runs on: the GPU it names, or the host for a simulated cpu:N."""
    return "cpu" if pool_device.startswith("cpu") else pool_device


def placements(settings: Settings, devices: list[str]) -> dict[str, list[str]]:
    """model name -> the devices it gets an engine on."""
    names = [m.name for m in settings.models]
    if settings.placement == "fixed":
        return {name: [device] for name, device in fixed_devices(names, devices).items()}
    return {name: list(devices) for name in names}


def start_models(settings: Settings, timeline: Timeline,
                 build: Callable[[Settings, Timeline, str], "Engine"]) -> StartedModels:
    """Build every model's engines (BUILD: a lone model's CPU phase, for its settings and device), pool them
    per device, make the first model resident (blocking)."""
    import torch

    from runtime.launch import resolve_device
    from runtime.pool.errors import PoolError
    from runtime.pool.pool import ModelPool, device_budget

    device_kind = resolve_device(settings.device)
    devices = pool_devices(settings, device_kind)
    where = placements(settings, devices)
    try:
        pools = {d: ModelPool(torch.device(engine_device(d)), device_budget(
            torch.device(engine_device(d)), settings.gpu_memory_utilization, settings.pool_memory_gb),
            settings.pool_eviction) for d in devices}
    except PoolError as exc:
        raise ConfigError(str(exc)) from None
    engines: dict[str, list[Placement]] = {}
    unbaked: dict[str, str] = {}
    for model in settings.models:
        for device in where[model.name]:
            engine = build(settings.for_model(model), timeline, engine_device(device))
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
    skipped = {path: "a several-model instance starts no CRIU snapshot (it holds one model's process)"
               for path in ("gpu", "process")}
    if unbaked:
        skipped["materialized"] = "; ".join(f"{name}: {why}" for name, why in unbaked.items())
    return StartedModels(engines, pools, settings.placement, "cold" if unbaked else "materialized", skipped,
                         [(device, report)])


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
