"""From settings to an engine: the one place that turns `Settings` into an `EngineConfig` and a built
(not yet started) `Engine`. The bootstrap, faas-build and the snapshot validators all start engines here."""

from __future__ import annotations

from pathlib import Path

from runtime.config import ConfigError, Settings
from runtime.engine.engine_config import EngineConfig
from runtime.timeline import Timeline


def resolve_device(device: str) -> str:
    if device != "auto":
        if device == "cuda":
            import torch

            if not torch.cuda.is_available():
                raise ConfigError("DEVICE=cuda but no CUDA GPU is visible")
        return device
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


#: a step's tokens on the cpu: a prompt of the default context in one step. A prompt in slices pays every op's
#: wait for all of torch's threads once per slice (3 slices of a 1,500-token prompt: about a sixth slower on
#: 2 cores), and a function on Lambda serves one request at a time: no decodes beside it to keep pace with.
CPU_STEP_TOKENS = 4096


def engine_config(settings: Settings, device: str | None = None) -> EngineConfig:
    device = device or resolve_device(settings.device)
    gpu = device.split(":")[0] == "cuda"
    dtype = settings.dtype if settings.dtype != "auto" else ("bfloat16" if gpu else "float32")
    return EngineConfig(
        device=device, dtype=dtype, max_model_len=settings.max_model_len,
        max_num_seqs=settings.max_num_seqs or (256 if gpu else 16),
        max_num_batched_tokens=settings.max_num_batched_tokens or (2048 if gpu else CPU_STEP_TOKENS),
        gpu_memory_utilization=settings.gpu_memory_utilization, enforce_eager=settings.enforce_eager,
        async_scheduling=settings.async_scheduling, enable_prefix_caching=settings.enable_prefix_caching,
        graph_prefill_tokens=settings.graph_prefill_tokens,
        cpu_threads=settings.cpu_threads, cpu_packed_weights=settings.cpu_packed_weights)


def build_engine(model_dir: Path, config: EngineConfig, timeline: Timeline | None = None,
                 model_name: str | None = None, settings: Settings | None = None):
    """The engine's CPU phase for a local model directory: a faas-build layout streams through the pipelined
    loader (runtime/weights/loader.py), a plain Hugging Face directory through hf_dir_loader."""
    from runtime.engine import Engine
    from runtime.weights.manifest import is_layout

    if not is_layout(Path(model_dir)):
        from runtime.weights.hf_dir import hf_dir_loader

        return Engine.build(model_dir, hf_dir_loader(Path(model_dir)), config, timeline, model_name)
    settings = settings or Settings.from_env()
    loader, config = _layout_loader(Path(model_dir), config, settings)
    return Engine.build(model_dir, loader, config, timeline, model_name)


def _layout_loader(layout_dir: Path, config: EngineConfig, settings: Settings):
    import dataclasses

    from runtime.weights.loader import LayoutLoader
    from runtime.weights.resolve import disk_cache
    from runtime.weights.sources import ORIGIN

    cache = disk_cache(settings.cache_dir, settings.cache_max_gb) if (layout_dir / ORIGIN).is_file() else None
    loader = LayoutLoader(layout_dir, cache=cache)
    if settings.dtype == "auto":  # a layout holds one dtype: auto means that one
        config = dataclasses.replace(config, dtype=loader.manifest.dtype)
    return loader, config
