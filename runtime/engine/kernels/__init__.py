"""The Triton kernels of the engine (decode attention, norms, rotary, activation, one-token projections)."""

from __future__ import annotations

import importlib

KERNEL_MODULES = ("activation", "gemv", "norm", "paged_attention", "rotary")


def prepare_kernels() -> None:
    """The CPU half of the kernels' first launch, done ahead: import Triton and the kernel modules, and
    compute Triton's key of its own sources (it hashes every compiler file and libtriton, ~0.4 s, on the
    first compile of a process). Measured on the H100 it was 0.7 s of the 1.5 s a materialised graph restore
    spent resolving kernels; in the engine's CPU phase it lands in the process snapshot instead."""
    for name in KERNEL_MODULES:
        importlib.import_module(f"runtime.engine.kernels.{name}")
    try:
        from triton.runtime.cache import triton_key
    except ImportError:  # another Triton version: its first compile pays it
        return
    triton_key()
    # Triton's first launch in a process also imports its code generator, and with it Gluon's language
    # modules: 0.4 s of the H100 machine's materialised kernel resolution (cProfile, Qwen2-1.5B)
    importlib.import_module("triton.compiler.code_generator")
