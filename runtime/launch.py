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


def engine_config(settings: Settings, device: str | None = None) -> EngineConfig:
    device = device or resolve_device(settings.device)
    dtype = settings.dtype if settings.dtype != "auto" else ("bfloat16" if device == "cuda" else "float32")
    return EngineConfig(
        device=device, dtype=dtype, max_model_len=settings.max_model_len,
        max_num_seqs=settings.max_num_seqs or (256 if device == "cuda" else 16),
        max_num_batched_tokens=settings.max_num_batched_tokens or 8192,
        gpu_memory_utilization=settings.gpu_memory_utilization, enforce_eager=settings.enforce_eager)


def build_engine(model_dir: Path, config: EngineConfig, timeline: Timeline | None = None,
                 model_name: str | None = None):
    """The engine's CPU phase for a local model directory (a Hugging Face directory or a faas-build layout)."""
    from runtime.engine import Engine
    from runtime.weights.hf_dir import hf_dir_loader

    return Engine.build(model_dir, hf_dir_loader(model_dir), config, timeline, model_name)
