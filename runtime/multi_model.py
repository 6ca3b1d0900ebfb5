"""Starting an instance that serves several models (MODEL=name=reference,...; docs/multi-model.md).

Each model's engine is built (the CPU phase: tokenizer, structure, weight plan) on every device its
placement gives it, and added to that device's ModelPool (runtime/pool); none is started yet. Then the
first model of the list is made resident on its first device, so the instance is ready with its weights
in place, as a lone model's is; every other model is made resident by its first request (a switch).

Devices: the GPU on CUDA, the host on CPU. POOL_CPU_DEVICES=N makes N host pools that stand for N GPUs,
which is how the placement policies (runtime/server/routing.py) run without a GPU.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from runtime.config import ConfigError, Settings
from runtime.logs import get_logger
from runtime.server.models import Placement, StartedModels
from runtime.server.routing import fixed_devices
from runtime.timeline import Timeline

if TYPE_CHECKING:
    from runtime.engine import Engine

log = get_logger("multi_model")


def pool_devices(settings: Settings, device: str) -> list[str]:
    """The devices an instance pools: one GPU (the engine runs on the current one), or the host once per
    POOL_CPU_DEVICES."""
    if device == "cpu":
        n = settings.pool_cpu_devices
        return ["cpu"] if n == 1 else [f"cpu:{i}" for i in range(n)]
    return ["cuda"]


def placements(settings: Settings, devices: list[str]) -> dict[str, list[str]]:
    """model name -> the devices it gets an engine on."""
    names = [m.name for m in settings.models]
    if settings.placement == "fixed":
        return {name: [device] for name, device in fixed_devices(names, devices).items()}
    return {name: list(devices) for name in names}


def start_models(settings: Settings, timeline: Timeline) -> StartedModels:
    """Build every model's engines, pool them per device, make the first model resident (blocking)."""
    import torch

    from runtime.bootstrap import build_fresh
    from runtime.launch import resolve_device
    from runtime.pool.errors import PoolError
    from runtime.pool.pool import ModelPool, device_budget

    device_kind = resolve_device(settings.device)
    devices = pool_devices(settings, device_kind)
    where = placements(settings, devices)
    try:
        pools = {d: ModelPool(torch.device(device_kind), device_budget(
            torch.device(device_kind), settings.gpu_memory_utilization, settings.pool_memory_gb),
            settings.pool_eviction) for d in devices}
    except PoolError as exc:
        raise ConfigError(str(exc)) from None
    engines: dict[str, list[Placement]] = {}
    for model in settings.models:
        for device in where[model.name]:
            engine: Engine = build_fresh(settings.for_model(model), timeline)
            try:
                pools[device].add(model.name, engine)
            except PoolError as exc:
                raise ConfigError(f"{device}: {exc}") from None
            engines.setdefault(model.name, []).append(Placement(device, engine))
    first = settings.models[0].name
    device = where[first][0]
    report = pools[device].activate(first)  # the engine's start: its weights, KV cache and graphs stages
    log.info("serving %d models on %s (placement %s); %s resident on %s", len(engines), ", ".join(devices),
             settings.placement, first, device)
    return StartedModels(engines, pools, settings.placement, "cold",
                         {path: "several models: each model starts cold in the pool" for path in
                          ("gpu", "process", "materialized")}, [(device, report)])
