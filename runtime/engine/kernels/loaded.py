"""How many compiled Triton specialisations of the engine's kernels this process has loaded: what a model's
first start adds to it is the kernels that start had to load (a model whose shape classes another model
already loaded adds none, runtime/engine/kernels/shape_class.py)."""

from __future__ import annotations

import sys


def loaded_specialisations() -> int:
    """Compiled specialisations held by the engine's kernels, over every device. Imports nothing: a kernel
    module that was never imported launched nothing (and a CPU start never imports Triton)."""
    from runtime.engine.kernels import KERNEL_MODULES

    jit = sys.modules.get("triton.runtime.jit")
    if jit is None:
        return 0
    count = 0
    for module in (sys.modules[name] for name in KERNEL_MODULES if name in sys.modules):
        for value in vars(module).values():
            if isinstance(value, jit.JITFunction):
                count += sum(_cache_size(entry) for entry in value.device_caches.values())
    return count


def _cache_size(entry) -> int:
    # Triton keeps, per device, a tuple whose first member maps a specialisation's key to its kernel
    cache = entry[0] if isinstance(entry, tuple) and entry else entry
    return len(cache) if isinstance(cache, dict) else 0
