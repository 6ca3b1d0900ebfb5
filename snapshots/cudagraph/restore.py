"""Rebuild the decode CUDA graphs in a fresh process from their materialised description (Medusa 5).

Order: the description is read on a thread while CUDA initialises (`read_ahead`); then check that the engine
allocated the same buffers in the same order, recreate the scratch segments, write this process's addresses
into every relocated parameter word (one vectorised pass over params.bin), resolve kernel names to handles
(their modules loading meanwhile on a thread of their own, KernelLoad), then add the nodes and instantiate
each graph. None of it needs the weights' values, so the engine does it before they stream in, or beside
them (`before_weights`); the graphs of larger batch sizes can be left until the engine serves
(MaterializedGraphs.before_ready_up_to).
"""

from __future__ import annotations

import ctypes
import threading
import time
from concurrent.futures import Future
from ctypes import POINTER, c_size_t, c_void_p
from pathlib import Path
from typing import Callable

import numpy as np
import torch

from runtime.background import in_background
from runtime.cuda_driver import graphs as cu
from runtime.engine.model_runner import ModelRunner
from runtime.logs import get_logger
from snapshots.cudagraph.kernels import KernelLoad, kernel_handles, load_kernels, warm_cublas
from snapshots.cudagraph.records import (ALLOC, KINDS, SEGMENT, EmptyNode, GraphRecord, GraphSet, KernelNode,
                                         MemsetNode, Relocation, RelocationTable, decode_attribute)

log = get_logger("snapshots.cudagraph")


class RestoredGraph:
    """A graph rebuilt from its description; replays on the current stream like torch's CUDAGraph."""

    def __init__(self, graph: int, graph_exec: int) -> None:
        self.graph, self.graph_exec = graph, graph_exec

    def replay(self) -> None:
        cu.launch(self.graph_exec, torch.cuda.current_stream().cuda_stream)

    def __del__(self) -> None:
        if cu._lib is not None:
            cu.destroy_graph_exec(self.graph_exec)
            cu.destroy_graph(self.graph)


class MaterializedGraphs:
    """The engine's GraphRestorer for a graph snapshot directory (see runtime/engine/llm_engine.py).

    `before_ready_up_to` splits the work: every description is loaded and patched, and the graphs up to that
    batch size are built, before the engine is ready; the larger ones are `pending`, built by
    `restore_pending` once the engine serves (their kernels are mostly cuBLAS's, loaded one module at a time,
    0.7-1 s for all 35 sizes on the H100). None builds every graph before ready."""

    #: A restore that builds no graph above this batch size runs before the weight copies start. Its kernels
    #: are Triton's (runtime/engine/kernels/gemv.py), and a module load copies its code to the GPU, behind the
    #: copies: beside them each took longer on the H100. A larger one runs beside them: its kernels
    #: are mostly cuBLAS's, whose loads are CPU-bound, and they overlap the stream (docs/snapshots.md).
    BEFORE_WEIGHTS_UP_TO = 8

    def __init__(self, directory: str | Path, before_ready_up_to: int | None = None) -> None:
        self.directory = Path(directory)
        self.before_ready_up_to = before_ready_up_to
        self.before_weights = before_ready_up_to is not None and before_ready_up_to <= self.BEFORE_WEIGHTS_UP_TO
        self.segments: list[torch.Tensor] = []  # scratch memory the restored graphs point into; kept alive
        self.timings: dict[str, float] = {}
        self.pending_timings: dict[str, float] = {}
        self._graph_set: GraphSet | None = None  # its unparsed graphs are the ones pending
        self._handles: dict[str, int] = {}
        self._bases: dict[tuple[str, int], int] = {}
        self._blob: np.ndarray | None = None
        self._reading: Future | None = None  # of _read_description

    @property
    def pending(self) -> list[int]:
        """The batch sizes left for `restore_pending`."""
        return sorted(self._graph_set.unparsed) if self._graph_set is not None else []

    def read_ahead(self) -> None:
        """Read the description on a thread, parsing the graphs of the sizes up to the limit."""
        if self._reading is None:
            self._reading = in_background(_read_description, self.directory, self.before_ready_up_to,
                                          name="graphs-read")

    def restore(self, runner: ModelRunner) -> dict[int, str]:
        wanted = set(runner.graph_batch_sizes)
        limit = self.before_ready_up_to
        now = {bs for bs in wanted if limit is None or bs <= limit}
        # With a limit the sizes built now are known before the description is read (every size of the
        # engine's up to the limit), so their kernels start loading at once
        early = KernelLoad(runner, sorted(now)) if limit is not None else None
        # for the first prefill and the graphs built after ready, while the weights stream in
        cublas = threading.Thread(target=warm_cublas, args=(torch.cuda.current_device(), runner.dtype),
                                  name="cublas-warm-up", daemon=True)
        cublas.start()
        fallbacks: dict[int, str] = {}
        try:
            fallbacks = self._load_and_patch(runner, wanted, now)
            if fallbacks:
                return fallbacks
            waited = time.perf_counter()
            if early is not None:
                names = kernel_names(self._graph_set.graphs)
                early.need(names)
                try:
                    found = early.result()
                except Exception as exc:  # _build loads what is still missing, on this thread
                    log.warning("loading the graphs' kernels ahead failed (%s); loading them now", exc)
                    found = {}
                self._handles.update(kernel_handles(found, names))
                self.timings["early_kernels_s"] = round(early.seconds, 4)
                self.timings.update(early.usage)
            self.timings["kernels_wait_s"] = round(time.perf_counter() - waited, 4)
            fallbacks, timings = self._build(runner, list(self._graph_set.graphs))
        finally:
            if early is not None:
                early.join()  # never left capturing while the engine captures live
            if fallbacks:
                cublas.join()  # nor calling cuBLAS: the engine captures the fallbacks live
        self.timings.update(timings)
        return fallbacks

    def _load_and_patch(self, runner: ModelRunner, wanted: set[int], now: set[int]) -> dict[int, str]:
        """Read the description (parsing only the graphs of the sizes built `now`), check the engine's
        allocations against it, recreate the scratch segments and patch every relocated word. If the
        allocations differ, the reason for every wanted graph (none is restored, none left pending); else
        nothing."""
        t0 = time.perf_counter()
        reading, self._reading = self._reading, None
        graph_set, params, read_s = (reading.result() if reading is not None
                                     else _read_description(self.directory, self.before_ready_up_to))
        graph_set.graphs = [g for g in graph_set.graphs if g.batch_size in now]
        loaded = time.perf_counter()
        mismatch = allocation_mismatch(graph_set, runner)
        if mismatch:
            return {bs: mismatch for bs in sorted(wanted & ({g.batch_size for g in graph_set.graphs}
                                                             | graph_set.unparsed.keys()))}
        bases = {(ALLOC, a.index): a.ptr for a in runner.allocator.log}
        for segment in graph_set.segments:
            memory = torch.empty(segment.size, dtype=torch.uint8, device=runner.device)
            if segment.contents:
                cu.copy_to_device(memory.data_ptr(), (self.directory / segment.contents).read_bytes())
            self.segments.append(memory)
            bases[(SEGMENT, segment.ordinal)] = memory.data_ptr()
        patching = time.perf_counter()
        self._bases, self._blob = bases, patch_parameters(params, graph_set.relocations, bases)
        for bs in [bs for bs in graph_set.unparsed if bs not in wanted]:  # graphs this engine never uses
            del graph_set.unparsed[bs]
        self._graph_set = graph_set
        t1 = time.perf_counter()
        self.timings = {"load_and_patch_s": round(t1 - t0, 4), "read_s": round(read_s, 4),
                        "read_wait_s": round(loaded - t0, 4), "segments_s": round(patching - loaded, 4),
                        "patch_s": round(t1 - patching, 4)}
        return {}

    def restore_pending(self, runner: ModelRunner, step_aside: Callable[[], None] | None = None) -> dict[int, str]:
        """Build the graphs `restore` left pending, each usable as soon as it is built. Safe while the engine
        serves: the kernel triggering runs on inputs of its own (ModelRunner.run_first_layers). STEP_ASIDE
        is called before each batch size's kernel triggering and each graph's build."""
        records = []
        for bs in self.pending:  # ~12,000 nodes for 31 graphs, parsed in Python: the GIL, a graph at a time
            if step_aside is not None:
                step_aside()
            records.append(self._graph_set.parse_graph(bs))
        fallbacks, self.pending_timings = self._build(runner, records, step_aside)
        self._blob, self._graph_set = None, None
        return fallbacks

    def _build(self, runner: ModelRunner, records: list[GraphRecord],
               step_aside: Callable[[], None] | None = None) -> tuple[dict[int, str], dict[str, float]]:
        t0 = time.perf_counter()
        needed = kernel_names(records) - self._handles.keys()
        if needed:
            found = load_kernels(runner, trigger_batch_sizes(records, needed), lambda names: needed <= names,
                                 step_aside=step_aside)
            self._handles.update(kernel_handles(found, needed))
        t1 = time.perf_counter()
        fallbacks = {}
        for record in records:
            if step_aside is not None:
                step_aside()
            try:
                runner.graphs[record.batch_size] = build_graph(record, self._blob.ctypes.data, self._handles,
                                                               self._bases)
            except KeyError as missing:
                fallbacks[record.batch_size] = f"kernel {str(missing)[:80]} is not loaded in this process"
            except cu.DriverError as exc:
                fallbacks[record.batch_size] = str(exc)
        # no device synchronise here: it waited for the weight stream too (0.5-0.7 s of the 8B shape's
        # build_s on the H100, for 4 graphs), and nothing here needs the device to be idle
        return fallbacks, {"kernels_s": round(t1 - t0, 4), "build_s": round(time.perf_counter() - t1, 4),
                           "built": len(records) - len(fallbacks)}


def _read_description(directory: Path, limit: int | None) -> tuple[GraphSet, bytes, float]:
    """`GraphSet.load`, parsing the graphs of the sizes up to `limit` (all: None), and the seconds it took."""
    start = time.perf_counter()
    graph_set, params = GraphSet.load(directory, parse=lambda bs: limit is None or bs <= limit)
    return graph_set, params, time.perf_counter() - start


def kernel_names(graphs: list[GraphRecord]) -> set[str]:
    return {n.name for g in graphs for n in g.nodes if isinstance(n, KernelNode)}


def trigger_batch_sizes(graphs: list[GraphRecord], needed: set[str] | None = None) -> list[int]:
    """The few batch sizes whose graphs, together, use every kernel name in `needed` (default: every kernel
    the graphs use), a greedy cover: one first-layer run at each loads every module, instead of one at each of
    the 35 sizes (Medusa 5.2's triggering, once per shape class). A layer's kernels are the whole graph's, so
    graph names suffice."""
    names = {g.batch_size: {n.name for n in g.nodes if isinstance(n, KernelNode)} for g in graphs}
    if needed is None:
        needed = set().union(*names.values()) if names else set()
    needed = set(needed)
    chosen: list[int] = []
    while needed and names:
        best = max(names, key=lambda bs: (len(names[bs] & needed), -bs))
        chosen.append(best)
        needed -= names.pop(best)
    return sorted(chosen)


def allocation_mismatch(graph_set: GraphSet, runner: ModelRunner) -> str | None:
    now = [(a.name, a.nbytes) for a in runner.allocator.log]
    then = [tuple(a) for a in graph_set.allocations]
    if now != then:
        first = next((i for i, (a, b) in enumerate(zip(now, then)) if a != b), min(len(now), len(then)))
        return (f"the engine's allocations differ from the snapshot's at #{first} "
                f"({now[first] if first < len(now) else None} vs {then[first] if first < len(then) else None})")
    return None


def patch_parameters(params: bytes, relocations: RelocationTable, bases: dict[tuple[str, int], int]) -> np.ndarray:
    """A copy of params.bin with every relocated word rewritten to this process's address (one vectorised
    pass: a base per region, looked up by (kind, index), plus each word's offset inside it)."""
    blob = np.frombuffer(params, dtype=np.uint8).copy()
    rows = relocations.rows
    if not len(rows):
        return blob
    width = max(int(rows["index"].max()), max(i for _, i in bases)) + 1
    base = np.zeros((len(KINDS), width), dtype=np.uint64)
    known = np.zeros((len(KINDS), width), dtype=bool)
    for (kind, index), address in bases.items():
        if index >= 0:
            base[KINDS.index(kind), index], known[KINDS.index(kind), index] = address, True
    if not known[rows["kind"], rows["index"]].all():
        missing = rows[~known[rows["kind"], rows["index"]]][0]
        raise KeyError(f"no address for region {KINDS[missing['kind']]} {missing['index']}")
    blob.view(np.uint64)[rows["word"]] = base[rows["kind"], rows["index"]] + rows["delta"].astype(np.uint64)
    return blob


def build_graph(record: GraphRecord, blob_address: int, handles: dict[str, int],
                bases: dict[tuple[str, int], int]) -> RestoredGraph:
    graph = cu.create_graph()
    try:
        nodes: list[int] = []
        attributes: dict[str, bytes] = {}
        # Nodes first, then every edge (with its type: programmatic edges included) in one call.
        for node in record.nodes:
            if isinstance(node, KernelNode):
                nodes.append(_add_kernel(graph, node, blob_address, handles, attributes))
            elif isinstance(node, MemsetNode):
                nodes.append(cu.add_memset_node(graph, _memset_params(node, bases)))
            elif isinstance(node, EmptyNode):
                nodes.append(cu.add_empty_node(graph))
        edges = [(nodes[dep], nodes[i], node.edges[j] if node.edges else (0, 0, 0))
                 for i, node in enumerate(record.nodes) for j, dep in enumerate(node.deps)]
        cu.add_dependencies(graph, edges)
        return RestoredGraph(graph, cu.instantiate(graph))
    except BaseException:
        cu.destroy_graph(graph)
        raise


def _add_kernel(graph: int, node: KernelNode, blob_address: int, handles: dict[str, int],
                attributes: dict[str, bytes]) -> int:
    params = cu.KernelNodeParams(func=handles[node.name], gridDimX=node.grid[0], gridDimY=node.grid[1],
                                 gridDimZ=node.grid[2], blockDimX=node.block[0], blockDimY=node.block[1],
                                 blockDimZ=node.block[2], sharedMemBytes=node.shared_mem)
    size = c_size_t(node.params_size)
    if node.params_size:
        # One packed buffer per kernel, whatever way it was launched: the driver copies it at node creation.
        extra = (c_void_p * 5)(cu.LAUNCH_PARAM_BUFFER_POINTER, blob_address + node.params_offset,
                               cu.LAUNCH_PARAM_BUFFER_SIZE, ctypes.addressof(size), cu.LAUNCH_PARAM_END)
        params.extra = ctypes.cast(extra, POINTER(c_void_p))
    handle = cu.add_kernel_node(graph, params)
    for attribute, encoded in node.attributes.items():
        raw = attributes.get(encoded)
        if raw is None:
            raw = attributes[encoded] = decode_attribute(encoded)
        cu.set_kernel_node_attribute(handle, attribute, raw)
    return handle


def _memset_params(node: MemsetNode, bases: dict[tuple[str, int], int]) -> cu.MemsetNodeParams:
    dst: Relocation = node.dst
    return cu.MemsetNodeParams(dst=bases[(dst.kind, dst.index)] + dst.delta, pitch=node.pitch, value=node.value,
                               elementSize=node.element_size, width=node.width, height=node.height)
