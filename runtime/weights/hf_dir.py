"""Loading a plain Hugging Face directory (safetensors, sharded or not) into the engine's weight buffer."""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors import safe_open

from runtime.engine.weight_plan import WeightPlan, tensor_views


class _Loaded:
    def wait(self) -> None:
        if torch.cuda.is_available():
            torch.cuda.synchronize()


def hf_dir_loader(model_dir: Path):
    def load(plan: WeightPlan, buffer: torch.Tensor) -> _Loaded:
        views = tensor_views(buffer, plan)
        handles = {}
        for path in sorted(Path(model_dir).glob("*.safetensors")):
            f = safe_open(str(path), "pt")
            handles.update({name: f for name in f.keys()})
        for t in plan.tensors:
            for s in t.sources:
                views[t.name][s.row:s.row + s.rows].copy_(handles[s.name].get_tensor(s.name))
        return _Loaded()

    return load
