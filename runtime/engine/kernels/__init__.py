"""The Triton kernels of the engine (embedding, rotary with the KV write, decode attention, norms, activation,
few-token projections, greedy sampling with log-probabilities)."""

from __future__ import annotations

import importlib
import subprocess
from typing import Iterable

#: every module with Triton kernels the engine launches, the weight loader's device checksum included
KERNEL_MODULES = tuple(f"runtime.engine.kernels.{name}" for name in ("activation", "embedding", "gemv", "norm",
                                                                       "paged_attention", "rotary", "sampling")) + (
    "runtime.weights.checksum_kernel",)


def prepare_kernels() -> None:
    """The CPU half of the kernels' first launch, done ahead, so that in the engine's CPU phase it lands in
    the process snapshot: import Triton and the kernel modules, Triton's key of its own sources (it hashes
    every compiler file and libtriton, ~0.4 s, on the first compile of a process), its code generator, each
    kernel's cache key (a walk over the kernel's syntax tree and everything it calls, on its first launch),
    what Triton asks of two programs it runs (`file`, `ptxas --version`) and where libcuda lives (an
    `ldconfig -p`). In a fresh process these are most of what a materialised graph restore spends resolving
    kernels (docs/snapshots.md)."""
    modules = [importlib.import_module(name) for name in KERNEL_MODULES]
    try:
        from triton import knobs
        from triton.backends.nvidia.driver import libcuda_dirs
        from triton.runtime.build import platform_key
        from triton.runtime.cache import triton_key
        from triton.runtime.jit import JITFunction
    except ImportError:  # another Triton version: its first compile pays for these
        return
    triton_key()
    # programs Triton runs once a process, at its first launch: `file` on the interpreter (the key of its
    # compiled helper modules) and `ptxas --version` (to find the tool; it asks once more per GPU
    # architecture, which needs the device): 20-30 ms of a restored runtime's first launch on the H200
    # machine, kept by Triton once asked
    platform_key()
    try:
        knobs.nvidia.ptxas  # noqa: B018 - finds the tool and its version once, then cached by path
    except RuntimeError:  # no ptxas in this install: a compile would fail anyway, and says why then
        pass
    # Triton's first launch in a process also imports its code generator, and with it Gluon's language
    # modules: 0.4 s of the H100 machine's materialised kernel resolution (cProfile, Qwen2-1.5B)
    importlib.import_module("triton.compiler.code_generator")
    for module in modules:
        for value in vars(module).values():
            if isinstance(value, JITFunction):
                value.cache_key  # noqa: B018 - computed once and kept on the function
    try:
        libcuda_dirs()
    except (AssertionError, OSError):  # no driver on this machine (a CPU image): the GPU start looks it up
        pass


def ask_ptxas_for(capabilities: Iterable[int]) -> None:
    """Triton runs `ptxas --version` once more per GPU architecture, at a process's first launch (the answer is
    part of every kernel's cache key), and keeps the answer per architecture. Asked here for CAPABILITIES
    (major * 10 + minor) before a process snapshot is frozen, the restored runtime's first launch runs no program:
    on the H200 machine 2.4 ms in a fresh process (scripts/probe_first_launch.py), and from cold disk ptxas's
    25.7 MiB read behind the weights."""
    try:
        from triton.backends.nvidia.compiler import get_ptxas_version
    except ImportError:  # another Triton version: the restored runtime asks, as it would have
        return
    for capability in capabilities:
        try:
            get_ptxas_version(capability)
        except (OSError, RuntimeError, subprocess.CalledProcessError, TypeError):
            pass  # no ptxas, or a Triton whose ask takes no architecture: the restored runtime asks then
