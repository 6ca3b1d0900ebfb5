"""Loading a plain Hugging Face directory (safetensors, sharded or not) into the engine's weight buffer."""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors import safe_open

from runtime.engine.weight_plan import WeightPlan, tensor_views


class CopiedLoad:
    """A load that was done when it was called (its copies may still be queued on the GPU)."""

    def wait(self) -> None:
        if torch.cuda.is_available():
            torch.cuda.synchronize()

    def detail(self) -> dict:
        return {}  # copied in one pass as it was called: nothing to report


def hf_dir_loader(model_dir: Path):
    """A LoadWeights for the engine: one pass over the *.safetensors files, copying each tensor (converted to
    the engine's dtype) into its rows of the flat buffer."""

    def load(plan: WeightPlan, buffer: torch.Tensor) -> CopiedLoad:
        views = tensor_views(buffer, plan)
        files = sorted(Path(model_dir).glob("*.safetensors"))
        if not files:
            raise FileNotFoundError(f"{model_dir} has no *.safetensors files")
        where = {}
        for file in files:
            with safe_open(str(file), "pt") as f:
                where.update({name: file for name in f.keys()})
        missing = [name for name in plan.source_names() if name not in where]
        if missing:
            raise ValueError(f"{model_dir}: {len(missing)} weights missing, e.g. {missing[0]}")
        for file in files:
            with safe_open(str(file), "pt") as f:
                for t in plan.tensors:
                    for s in t.sources:
                        if where[s.name] == file:
                            views[t.name][s.row:s.row + s.rows].copy_(f.get_tensor(s.name))
        return CopiedLoad()

    return load
