"""How many compiled Triton specialisations of the engine's kernels this process has loaded: what a model's
first start adds to it is the kernels that start had to load (a model whose shape classes another model
already loaded adds none, runtime/engine/kernels/shape_class.py)."""

from __future__ import annotations

import importlib
import sys


def loaded_specialisations() -> int:
    """Compiled specialisations held by the engine's kernels, over every device (0 without Triton, or before
    any kernel module was imported)."""
    from runtime.engine.kernels import KERNEL_MODULES

    try:
        from triton.runtime.jit import JITFunction
    except ImportError:
        return 0
    count = 0
    for name in KERNEL_MODULES:
        if name not in sys.modules:  # never imported: nothing of it launched
            continue
        for value in vars(importlib.import_module(name)).values():
            if isinstance(value, JITFunction):
                count += sum(_cache_size(entry) for entry in getattr(value, "device_caches", {}).values())
    return count


def _cache_size(entry) -> int:
    # Triton keeps, per device, a tuple whose first member maps a specialisation's key to its kernel
    cache = entry[0] if isinstance(entry, tuple) and entry else entry
    return len(cache) if isinstance(cache, dict) else 0
