"""Read a captured CUDA graph into its materialised description (bake time, on the GPU).

Kernel parameters are read as one raw buffer laid out as the kernel expects it, whether the launch passed
them one by one (kernelParams: PyTorch, Triton) or as one packed struct (extra: cuBLAS's nvjet kernels, whose
struct holds device pointers inside it), so relocation looks at every aligned word either way.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass, field

from runtime.cuda_driver import graphs as cu
from snapshots.cudagraph.records import (ALLOC, EmptyNode, GraphRecord, KernelNode, MemsetNode, Node, Relocation,
                                        encode_attribute)
from snapshots.cudagraph.relocate import RegionIndex


@dataclass
class Description:
    record: GraphRecord
    problems: list[str] = field(default_factory=list)  # why this graph cannot be restored, if anything
    functions: dict[str, set[int]] = field(default_factory=dict)  # kernel name -> the handles seen for it


def describe_graph(graph: int, batch_size: int, regions: RegionIndex, blob: bytearray,
                   relocations: list[tuple[int, Relocation]]) -> Description:
    """Append the graph's parameter buffers to `blob`, and their relocations (with the buffer's offset in
    `blob`) to `relocations`; return its nodes in topological order."""
    handles = topological_order(graph)
    position = {h: i for i, h in enumerate(handles)}
    nodes: list[Node] = []
    problems: list[str] = []
    functions: dict[str, set[int]] = {}
    for handle in handles:
        incoming = cu.node_dependencies(handle)
        deps = [position[d] for d, _ in incoming]
        kind = cu.node_type(handle)
        if kind == cu.NODE_KERNEL:
            node, func = _kernel_node(handle, deps, regions, blob, relocations, problems)
            functions.setdefault(node.name, set()).add(func)
        elif kind == cu.NODE_MEMSET:
            node = _memset_node(handle, deps, regions, problems)
        else:
            if kind != cu.NODE_EMPTY:
                problems.append(f"unsupported {cu.NODE_TYPE_NAMES.get(kind, kind)} node")
            node = EmptyNode(deps)
        if any(edge != (0, 0, 0) for _, edge in incoming):
            node.edges = [edge for _, edge in incoming]
        nodes.append(node)
    return Description(GraphRecord(batch_size, nodes), problems, functions)


def topological_order(graph: int) -> list[int]:
    handles = cu.graph_nodes(graph)
    deps = {h: [d for d, _ in cu.node_dependencies(h)] for h in handles}
    done: set[int] = set()
    order: list[int] = []
    pending = list(handles)
    while pending:
        ready = [h for h in pending if all(d in done for d in deps[h])]
        if not ready:
            raise cu.DriverError("graph has a dependency cycle")
        for h in ready:
            order.append(h)
            done.add(h)
        pending = [h for h in pending if h not in done]
    return order


def kernel_function(params: cu.KernelNodeParams) -> int:
    return params.func or cu.kernel_function(params.kern)


def parameter_buffer(params: cu.KernelNodeParams, func: int) -> bytes:
    if params.kernelParams:
        layout = cu.function_param_layout(func)
        size = max((offset + n for offset, n in layout), default=0)
        buffer = bytearray(size)
        for i, (offset, n) in enumerate(layout):
            source = params.kernelParams[i]
            if not source:
                raise cu.DriverError(f"kernel node has no value for parameter {i}")
            buffer[offset:offset + n] = ctypes.string_at(source, n)
        return bytes(buffer)
    if params.extra:
        pointer, size = None, None
        for i in range(0, 16, 2):  # (key, value) pairs up to LAUNCH_PARAM_END; NULL reads back as None
            key = params.extra[i] or cu.LAUNCH_PARAM_END
            if key == cu.LAUNCH_PARAM_END:
                break
            value = params.extra[i + 1]
            if key == cu.LAUNCH_PARAM_BUFFER_POINTER:
                pointer = value
            elif key == cu.LAUNCH_PARAM_BUFFER_SIZE:
                size = ctypes.c_size_t.from_address(value).value
        if pointer is None or size is None:
            raise cu.DriverError("kernel node's extra[] has no parameter buffer")
        return ctypes.string_at(pointer, size)
    return b""


def _kernel_node(handle: int, deps: list[int], regions: RegionIndex, blob: bytearray,
                 relocations: list[tuple[int, Relocation]], problems: list[str]) -> tuple[KernelNode, int]:
    params = cu.kernel_node_params(handle)
    func = kernel_function(params)
    name = cu.function_name(func)
    buffer = parameter_buffer(params, func)
    for offset, value in regions.unmatched_words(buffer):
        if cu.device_range(value) is not None:
            problems.append(f"{name[:60]}: parameter word at byte {offset} points to device memory the engine "
                            "did not allocate")
    attributes = {}
    for attribute in cu.KERNEL_NODE_ATTRIBUTES:
        raw = cu.kernel_node_attribute(handle, attribute)
        if raw is not None and any(raw):
            attributes[attribute] = encode_attribute(raw)
    offset = len(blob)
    blob.extend(buffer)
    blob.extend(b"\0" * (-len(blob) % 8))
    relocations.extend((offset, r) for r in regions.relocations(buffer))
    node = KernelNode(name, (params.gridDimX, params.gridDimY, params.gridDimZ),
                      (params.blockDimX, params.blockDimY, params.blockDimZ), params.sharedMemBytes,
                      offset, len(buffer), attributes, deps)
    return node, func


def _memset_node(handle: int, deps: list[int], regions: RegionIndex, problems: list[str]) -> MemsetNode:
    p = cu.memset_node_params(handle)
    hit = regions.resolve(p.dst)
    if hit is None:
        problems.append("memset into device memory the engine did not allocate")
        dst = Relocation(0, ALLOC, -1, 0)
    else:
        region, delta = hit
        dst = Relocation(0, region.kind, region.index, delta)
    return MemsetNode(dst, p.value, p.elementSize, p.width, p.height, p.pitch, deps)
