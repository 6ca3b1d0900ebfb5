"""Programmatic dependent launch (Hopper and later) between the engine's own kernels in a CUDA graph: the next
kernel is launched while the one before it still runs, and waits for it inside, just before its first memory
access.

A batch-1 decode step of Llama-3-8B is about 260 kernels in a row: passes over a weight matrix, each with a
tail where its last programs leave most SMs idle, and small kernels (norms, rotary, attention) that run on a
few SMs. With a plain edge between two kernels, the second is launched only after the last program of the
first has ended; with a programmatic one, its programs are already resident, waiting, and start the moment
the first finishes (docs/engine.md, "Dependent launch", for what it gains).

Each engine kernel waits for its predecessor (`wait_for_previous`) before it reads or writes anything, in
every program, and then, in a graph captured under `early_start`, lets its successor launch. The relation
lives in the graph's edges, set after the capture (`link_engine_kernels`): an edge between two engine kernels
becomes programmatic, and an edge from an engine kernel to any other kernel is plain, since a library kernel
(cuBLAS's, which cuBLAS launches as a dependent itself) is not known to wait for what the engine kernel
writes. Outside such graphs the kernels let nothing start early, and launched plainly, their wait is a no-op.

Only graphs made of engine kernels alone start early: the decode steps of one to eight tokens, whose
projections are the engine's own (runtime/engine/kernels/gemv.py). On the H100, graphs that also held cuBLAS
kernels, with the engine kernels starting their successors early, matched eager live but their materialised
copies did not reproduce them (docs/engine.md, "Dependent launch"), so those graphs keep the triggers off:
their engine kernels still wait, which is then a no-op or a wait on a programmatic edge from another engine
kernel, and those graphs reproduce bit for bit.

The chain is sound because every kernel on a programmatic edge waits: a kernel past its wait knows its
predecessor has finished, which had itself waited for its own. Off in Triton's CPU interpreter (which has no
grid dependency control) and before Hopper, where the flag compiles the instructions out.
"""

from __future__ import annotations

import functools
import os
import threading
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Iterator

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

#: the kernels that wait for their predecessor first (their `wait_for_previous`), by name
ENGINE_KERNELS = frozenset({
    "_embedding_kernel", "_rms_norm_kernel", "_head_rms_norm_kernel", "_add_rms_norm_kernel", "_silu_and_mul_kernel",
    "_rotary_store_kv_kernel", "_paged_attention_kernel", "_gemv_kernel", "_gated_gemv_kernel", "_few_rows_kernel"})

# (from port, to port, type) of a graph edge: CU_GRAPH_KERNEL_NODE_PORT_PROGRAMMATIC and
# CU_GRAPH_DEPENDENCY_TYPE_PROGRAMMATIC, or the defaults
PROGRAMMATIC_EDGE = (1, 0, 1)
PLAIN_EDGE = (0, 0, 0)


@functools.cache
def _supported(index: int) -> bool:
    if os.environ.get("TRITON_INTERPRET") == "1":
        return False
    return torch.cuda.get_device_capability(index)[0] >= 9


def supported(device: torch.device) -> bool:
    """Whether DEVICE has grid dependency control (and the kernels are compiled with it)."""
    if device.type != "cuda":
        return False
    return _supported(device.index if device.index is not None else torch.cuda.current_device())


_early = threading.local()  # per thread: a capture is one thread's, and another may launch meanwhile


@contextmanager
def early_start(on: bool) -> Iterator[None]:
    """Within: the engine kernels this thread launches let their successors launch early (a capture of a graph
    of engine kernels alone, which `link_engine_kernels` then joins)."""
    before = getattr(_early, "on", False)
    _early.on = on
    try:
        yield
    finally:
        _early.on = before


def launch_options(device: torch.device) -> dict:
    """Keywords for an engine kernel's launch on DEVICE: whether it is compiled with the wait, and whether it lets
    its successor launch early (`early_start`)."""
    if not supported(device):
        return {"PDL": False, "early": 0}
    return {"PDL": True, "early": int(getattr(_early, "on", False))}


@triton.jit
def wait_for_previous(early, PDL: tl.constexpr):
    """Wait until the previous kernel has finished and its writes are visible, then (EARLY) let the next one
    launch."""
    if PDL:
        gdc_wait()
        if early != 0:
            gdc_launch_dependents()


@dataclass
class LinkedGraph:
    programmatic_edges: int  # edges between two engine kernels
    library_kernels: int  # kernels that are not the engine's (cuBLAS's)


def link_engine_kernels(graph: int) -> LinkedGraph:
    """Make every edge between two engine kernels of the captured GRAPH (a CUgraph, not yet instantiated)
    programmatic, and every edge from an engine kernel to another kernel plain."""
    from runtime.cuda_driver import graphs as cu

    names = _kernel_names(graph)
    old, new, programmatic = [], [], 0
    for node, name in names.items():
        for source, edge in cu.node_dependencies(node):
            if source not in names or names[source] not in ENGINE_KERNELS:
                continue
            wanted = PROGRAMMATIC_EDGE if name in ENGINE_KERNELS else PLAIN_EDGE
            programmatic += wanted == PROGRAMMATIC_EDGE
            if edge != wanted:
                old.append((source, node, edge))
                new.append((source, node, wanted))
    cu.remove_dependencies(graph, old)
    cu.add_dependencies(graph, new)
    return LinkedGraph(programmatic, sum(1 for name in names.values() if name not in ENGINE_KERNELS))


def _kernel_names(graph: int) -> dict[int, str]:
    from runtime.cuda_driver import graphs as cu

    return {node: cu.kernel_node_name(node) for node in cu.graph_nodes(graph) if cu.node_type(node) == cu.NODE_KERNEL}
