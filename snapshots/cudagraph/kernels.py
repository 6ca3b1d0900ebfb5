"""Kernel names to this process's function handles (Medusa 5.2, "triggering kernels").

Handles differ per process and many kernels (cuBLAS's) are in no symbol table. Running the first decoder
layer (plus the final norm and lm_head) once per batch size loads every module a full decode step uses —
lazily loaded PyTorch modules, cuBLAS's choices for each shape, the Triton kernels from the baked cache —
and capturing that small forward shows which handle each name has. Names still missing after that are
looked up among all functions of the modules already found. A name that turns out to belong to two different
functions (two specialisations of one Triton kernel, say) is left unresolved: the graphs that need it are
captured live rather than risk the wrong code.

Why triggering cannot be skipped for cuBLAS: on the H100 (CUDA 12.9 driver) each of cuBLAS's `nvjet` kernels
is a module of its own, one function, loaded lazily at its first launch (2-3 ms each), and the decode graphs
of Qwen2-1.5B use about 100 of them across the 35 sizes. Enumerating the modules already loaded finds none of
the missing ones (measured on the H100), and loading from several threads at once was no faster.
"""

from __future__ import annotations

import threading
import time
from typing import Callable

import torch

from runtime.cuda_driver import graphs as cu
from runtime.cuda_driver.device import private_stream, use_device
from runtime.engine.model_runner import ModelRunner
from runtime.logs import get_logger
from runtime.timeline import thread_usage
from snapshots.cudagraph.describe import kernel_function

log = get_logger("snapshots.cudagraph")


def load_kernels(runner: ModelRunner, batch_sizes: list[int], enough: Callable[[set[str]], bool] | None = None,
                 found: dict[str, set[int]] | None = None,
                 step_aside: Callable[[], None] | None = None) -> dict[str, set[int]]:
    """Run the first layers at each batch size, capture them, and return each kernel name's function handles
    (added to `found`, if given). Stops early once `enough(names found so far)` says so. STEP_ASIDE, if
    given, is called before each batch size (the engine may be serving meanwhile)."""
    found = {} if found is None else found
    # a capture needs a stream other than the legacy default, and one no other thread is handed
    # (runtime/cuda_driver/device.py); not the runner's: its graphs may be captured on it meanwhile
    stream = private_stream(runner.device)
    with torch.inference_mode():
        graphs: list[torch.cuda.CUDAGraph] = []  # alive until all are read: they share one pool
        for bs in batch_sizes:
            if step_aside is not None:
                step_aside()
            runner.run_first_layers(bs)  # loads this shape's modules outside the capture
            graph = torch.cuda.CUDAGraph(keep_graph=True)
            # capture_begin/end rather than torch.cuda.graph, whose entry synchronises the device (waiting for
            # the weights still streaming in) and empties the allocator caches: this graph is never replayed
            with torch.cuda.stream(stream):
                graph.capture_begin(pool=graphs[0].pool() if graphs else None, capture_error_mode="thread_local")
                try:
                    runner.run_first_layers(bs)
                finally:
                    graph.capture_end()
            graphs.append(graph)
            for node in cu.graph_nodes(graph.raw_cuda_graph()):
                if cu.node_type(node) == cu.NODE_KERNEL:
                    func = kernel_function(cu.kernel_node_params(node))
                    found.setdefault(cu.function_name(func), set()).add(func)
            if enough is not None and enough(found.keys()):  # the other shapes add nothing the graphs need
                break
        del graphs
    return found


def kernel_handles(found: dict[str, set[int]], names: set[str]) -> dict[str, int]:
    """A handle per name `load_kernels` found (a name seen with two different functions is left out), and for
    the names in `names` it did not find, one from the functions of the modules already loaded."""
    handles = {name: next(iter(funcs)) for name, funcs in found.items() if len(funcs) == 1}
    missing = names - found.keys()
    if missing:
        for module in {cu.function_module(f) for f in handles.values()}:
            for func in cu.module_functions(module):
                name = cu.function_name(func)
                if name in missing:
                    handles[name] = func
    return handles


def warm_cublas(device: int, dtype: torch.dtype) -> None:
    """cuBLAS's first call in a process sets the library up: 70-100 ms on the H100, whatever the shape, after
    which a new shape's kernel costs 2-4 ms. The decode graphs built before ready need no cuBLAS (runtime/
    engine/kernels/gemv.py), but the first prefill and the graphs built after ready do: run on a thread of its
    own, this overlaps the weight stream. A failure costs only time, so it is logged."""
    try:
        use_device(torch.device("cuda", device))  # the current device is per thread
        with torch.inference_mode():
            x = torch.zeros(2, 256, device=torch.device("cuda", device), dtype=dtype)
            torch.nn.functional.linear(x, torch.zeros(256, 256, device=x.device, dtype=dtype))
            torch.cuda.current_stream(x.device).synchronize()
    except Exception as exc:
        log.warning("warming cuBLAS up failed: %s", exc)


class KernelLoad:
    """`load_kernels` on a thread of its own, started before the graphs' description is needed, so that the
    module loads it waits on overlap checking and patching the description. It goes through `batch_sizes` in
    order until `need` has named the kernels and they are all found: each size can load modules of its own
    that no graph needs. `result()` joins it; `seconds` is how long it ran, `usage` what its thread did
    meanwhile (runtime/timeline.py: thread_usage; from cold disk, whether it waited on files' pages)."""

    def __init__(self, runner: ModelRunner, batch_sizes: list[int]) -> None:
        self.seconds = 0.0
        self.usage: dict[str, float] = {}
        self._names: set[str] | None = None
        self._found: dict[str, set[int]] = {}
        self._error: BaseException | None = None
        self._device = torch.cuda.current_device()  # the current device is per thread: the new one takes ours
        self._thread = threading.Thread(target=self._run, args=(runner, batch_sizes), name="graph-kernels",
                                        daemon=True)
        self._thread.start()

    def _run(self, runner: ModelRunner, batch_sizes: list[int]) -> None:
        start = time.perf_counter()
        try:
            with thread_usage(self.usage, "early_kernels"):
                use_device(torch.device("cuda", self._device))
                load_kernels(runner, batch_sizes, self._covers, found=self._found)
        except BaseException as exc:  # raised again in the thread that asks for the result
            self._error = exc
        self.seconds = time.perf_counter() - start

    def need(self, names: set[str]) -> None:
        """The kernels the graphs use, once their description is read."""
        self._names = names

    def _covers(self, found: set[str]) -> bool:
        names = self._names
        return names is not None and names <= found

    def join(self) -> None:
        self._thread.join()

    def result(self) -> dict[str, set[int]]:
        self._thread.join()
        if self._error is not None:
            raise self._error
        return self._found
