"""The driver calls that reading and rebuilding CUDA graphs needs (snapshots/cudagraph), through ctypes.

Restoring a graph adds thousands of nodes; each call here is one C call on one packed struct, which keeps
the restore cheap (cuda-bindings builds Python objects per field and per parameter). Every call is checked
and fails with DriverError naming the driver's own error.
"""

from __future__ import annotations

import ctypes
from ctypes import POINTER, byref, c_char_p, c_int, c_size_t, c_uint, c_uint64, c_void_p

from runtime.cuda_driver import DriverError

# CUgraphNodeType
NODE_KERNEL, NODE_MEMCPY, NODE_MEMSET, NODE_EMPTY = 0, 1, 2, 5
NODE_TYPE_NAMES = {0: "kernel", 1: "memcpy", 2: "memset", 3: "host", 4: "graph", 5: "empty", 6: "wait_event",
                   7: "event_record", 8: "ext_sema_signal", 9: "ext_sema_wait", 10: "mem_alloc", 11: "mem_free",
                   12: "batch_mem_op", 13: "conditional"}
# extra[] keys of cuLaunchKernel
LAUNCH_PARAM_END, LAUNCH_PARAM_BUFFER_POINTER, LAUNCH_PARAM_BUFFER_SIZE = 0, 1, 2
# CUlaunchAttributeID values that are valid on kernel graph nodes
KERNEL_NODE_ATTRIBUTES = {1: "access_policy_window", 2: "cooperative", 4: "cluster_dimension",
                          5: "cluster_scheduling_policy", 8: "priority", 9: "mem_sync_domain_map",
                          10: "mem_sync_domain", 11: "preferred_cluster_dimension",
                          14: "preferred_shared_memory_carveout"}
ATTRIBUTE_VALUE_BYTES = 64
POINTER_ATTRIBUTE_MEMORY_TYPE, POINTER_ATTRIBUTE_RANGE_START, POINTER_ATTRIBUTE_RANGE_SIZE = 2, 11, 12
MEMORY_TYPE_DEVICE = 2
ERROR_INVALID_VALUE = 1


class KernelNodeParams(ctypes.Structure):
    _fields_ = [("func", c_void_p), ("gridDimX", c_uint), ("gridDimY", c_uint), ("gridDimZ", c_uint),
                ("blockDimX", c_uint), ("blockDimY", c_uint), ("blockDimZ", c_uint), ("sharedMemBytes", c_uint),
                ("kernelParams", POINTER(c_void_p)), ("extra", POINTER(c_void_p)), ("kern", c_void_p),
                ("ctx", c_void_p)]


class MemsetNodeParams(ctypes.Structure):
    _fields_ = [("dst", c_uint64), ("pitch", c_size_t), ("value", c_uint), ("elementSize", c_uint),
                ("width", c_size_t), ("height", c_size_t)]


AttributeValue = ctypes.c_ubyte * ATTRIBUTE_VALUE_BYTES

_lib: ctypes.CDLL | None = None
_held: ctypes.PyDLL | None = None


def lib() -> ctypes.CDLL:
    global _lib
    if _lib is None:
        _lib = ctypes.CDLL("libcuda.so.1")
    return _lib


def lib_holding_gil() -> ctypes.PyDLL:
    """libcuda with the GIL kept across each call, for the calls a graph restore makes thousands of times at a
    few microseconds each. ctypes releases the GIL around every foreign call, and beside the weight stream one
    of its reader threads takes it each time, so the restore waited at every node to get it back."""
    global _held
    if _held is None:
        _held = ctypes.PyDLL("libcuda.so.1")
    return _held


def check(result: int, what: str) -> None:
    if result != 0:
        name, text = c_char_p(), c_char_p()
        lib().cuGetErrorName(result, byref(name))
        lib().cuGetErrorString(result, byref(text))
        raise DriverError(f"{what} failed: {(name.value or b'?').decode()} ({(text.value or b'').decode()})")


def graph_nodes(graph: int) -> list[int]:
    count = c_size_t(0)
    check(lib().cuGraphGetNodes(c_void_p(graph), None, byref(count)), "cuGraphGetNodes")
    nodes = (c_void_p * count.value)()
    check(lib().cuGraphGetNodes(c_void_p(graph), nodes, byref(count)), "cuGraphGetNodes")
    return [n or 0 for n in nodes[: count.value]]


def node_type(node: int) -> int:
    kind = c_int()
    check(lib().cuGraphNodeGetType(c_void_p(node), byref(kind)), "cuGraphNodeGetType")
    return kind.value


class EdgeData(ctypes.Structure):
    _fields_ = [("from_port", ctypes.c_ubyte), ("to_port", ctypes.c_ubyte), ("type", ctypes.c_ubyte),
                ("reserved", ctypes.c_ubyte * 5)]


def node_dependencies(node: int) -> list[tuple[int, tuple[int, int, int]]]:
    """(dependency, (from_port, to_port, type)) for each incoming edge. Edge data matters: cuBLAS kernels that
    use programmatic dependent launch are joined by programmatic edges, not plain ones."""
    # The _v2 entry point (CUDA 12.3+) returns edge data; CUDA 13 headers map the plain name to it, so the
    # versioned symbol is named explicitly to get one known signature.
    get = lib().cuGraphNodeGetDependencies_v2
    count = c_size_t(0)
    check(get(c_void_p(node), None, None, byref(count)), "cuGraphNodeGetDependencies")
    if count.value == 0:
        return []
    deps = (c_void_p * count.value)()
    edges = (EdgeData * count.value)()
    check(get(c_void_p(node), deps, edges, byref(count)), "cuGraphNodeGetDependencies")
    return [(deps[i] or 0, (edges[i].from_port, edges[i].to_port, edges[i].type)) for i in range(count.value)]


def add_dependencies(graph: int, edges: list[tuple[int, int, tuple[int, int, int]]]) -> None:
    """Add (from node, to node, (from_port, to_port, type)) edges in one call."""
    if edges:
        check(lib_holding_gil().cuGraphAddDependencies_v2(c_void_p(graph), *_edge_arrays(edges), c_size_t(len(edges))),
              "cuGraphAddDependencies")


def remove_dependencies(graph: int, edges: list[tuple[int, int, tuple[int, int, int]]]) -> None:
    """Remove these (from node, to node, (from_port, to_port, type)) edges, each as it is, in one call."""
    if edges:
        check(lib_holding_gil().cuGraphRemoveDependencies_v2(c_void_p(graph), *_edge_arrays(edges),
                                                             c_size_t(len(edges))), "cuGraphRemoveDependencies")


def _edge_arrays(edges: list[tuple[int, int, tuple[int, int, int]]]) -> tuple:
    n = len(edges)
    sources = (c_void_p * n)(*[e[0] for e in edges])
    targets = (c_void_p * n)(*[e[1] for e in edges])
    data = (EdgeData * n)()
    for i, (_, _, (from_port, to_port, kind)) in enumerate(edges):
        data[i].from_port, data[i].to_port, data[i].type = from_port, to_port, kind
    return sources, targets, data


def kernel_node_params(node: int) -> KernelNodeParams:
    params = KernelNodeParams()
    check(lib().cuGraphKernelNodeGetParams_v2(c_void_p(node), byref(params)), "cuGraphKernelNodeGetParams")
    return params


def memset_node_params(node: int) -> MemsetNodeParams:
    params = MemsetNodeParams()
    check(lib().cuGraphMemsetNodeGetParams(c_void_p(node), byref(params)), "cuGraphMemsetNodeGetParams")
    return params


def kernel_function(kernel: int) -> int:
    """The context's CUfunction of a context-independent CUkernel (cudart loads its kernels that way)."""
    func = c_void_p()
    check(lib().cuKernelGetFunction(byref(func), c_void_p(kernel)), "cuKernelGetFunction")
    return func.value or 0


def function_name(func: int) -> str:
    name = c_char_p()
    check(lib().cuFuncGetName(byref(name), c_void_p(func)), "cuFuncGetName")
    return name.value.decode()


def kernel_node_name(node: int) -> str:
    """The name of a kernel node's function (a context-independent kernel's too)."""
    params = kernel_node_params(node)
    return function_name(params.func or kernel_function(params.kern))


def function_param_layout(func: int) -> list[tuple[int, int]]:
    """(offset, size) of each parameter in the kernel's parameter buffer."""
    layout = []
    while True:
        offset, size = c_size_t(), c_size_t()
        result = lib().cuFuncGetParamInfo(c_void_p(func), c_size_t(len(layout)), byref(offset), byref(size))
        if result == ERROR_INVALID_VALUE:
            return layout
        check(result, "cuFuncGetParamInfo")
        layout.append((offset.value, size.value))


def function_module(func: int) -> int:
    module = c_void_p()
    check(lib().cuFuncGetModule(byref(module), c_void_p(func)), "cuFuncGetModule")
    return module.value or 0


def module_functions(module: int) -> list[int]:
    count = c_uint()
    check(lib().cuModuleGetFunctionCount(byref(count), c_void_p(module)), "cuModuleGetFunctionCount")
    funcs = (c_void_p * max(count.value, 1))()
    check(lib().cuModuleEnumerateFunctions(funcs, count, c_void_p(module)), "cuModuleEnumerateFunctions")
    return [f or 0 for f in funcs[: count.value]]


def kernel_node_attribute(node: int, attribute: int) -> bytes | None:
    value = AttributeValue()
    if lib().cuGraphKernelNodeGetAttribute(c_void_p(node), c_int(attribute), byref(value)) != 0:
        return None
    return bytes(value)


def set_kernel_node_attribute(node: int, attribute: int, raw: bytes) -> None:
    value = AttributeValue.from_buffer_copy(raw)
    check(lib_holding_gil().cuGraphKernelNodeSetAttribute(c_void_p(node), c_int(attribute), byref(value)),
          f"cuGraphKernelNodeSetAttribute({KERNEL_NODE_ATTRIBUTES.get(attribute, attribute)})")


def device_range(address: int) -> tuple[int, int] | None:
    """(start, size) of the device allocation holding `address`, or None if it is not device memory."""
    kind = c_uint()
    if lib().cuPointerGetAttribute(byref(kind), c_int(POINTER_ATTRIBUTE_MEMORY_TYPE), c_uint64(address)) != 0:
        return None
    if kind.value != MEMORY_TYPE_DEVICE:
        return None
    start, size = c_uint64(), c_size_t()
    check(lib().cuPointerGetAttribute(byref(start), c_int(POINTER_ATTRIBUTE_RANGE_START), c_uint64(address)),
          "cuPointerGetAttribute")
    check(lib().cuPointerGetAttribute(byref(size), c_int(POINTER_ATTRIBUTE_RANGE_SIZE), c_uint64(address)),
          "cuPointerGetAttribute")
    return start.value, size.value


def create_graph() -> int:
    graph = c_void_p()
    check(lib_holding_gil().cuGraphCreate(byref(graph), c_uint(0)), "cuGraphCreate")
    return graph.value


# Nodes are added without dependencies; add_dependencies then adds every edge with its edge data.

def add_kernel_node(graph: int, params: KernelNodeParams) -> int:
    node = c_void_p()
    check(lib_holding_gil().cuGraphAddKernelNode_v2(byref(node), c_void_p(graph), None, c_size_t(0),
                                                    byref(params)), "cuGraphAddKernelNode")
    return node.value


def add_memset_node(graph: int, params: MemsetNodeParams) -> int:
    node, ctx = c_void_p(), c_void_p()
    check(lib_holding_gil().cuCtxGetCurrent(byref(ctx)), "cuCtxGetCurrent")
    check(lib_holding_gil().cuGraphAddMemsetNode(byref(node), c_void_p(graph), None, c_size_t(0), byref(params),
                                                 ctx), "cuGraphAddMemsetNode")
    return node.value


def add_empty_node(graph: int) -> int:
    node = c_void_p()
    check(lib_holding_gil().cuGraphAddEmptyNode(byref(node), c_void_p(graph), None, c_size_t(0)),
          "cuGraphAddEmptyNode")
    return node.value


def instantiate(graph: int) -> int:
    graph_exec = c_void_p()
    check(lib().cuGraphInstantiateWithFlags(byref(graph_exec), c_void_p(graph), c_uint64(0)),
          "cuGraphInstantiateWithFlags")
    return graph_exec.value


def launch(graph_exec: int, stream: int) -> None:
    check(lib().cuGraphLaunch(c_void_p(graph_exec), c_void_p(stream)), "cuGraphLaunch")


def destroy_graph(graph: int) -> None:
    lib().cuGraphDestroy(c_void_p(graph))


def destroy_graph_exec(graph_exec: int) -> None:
    lib().cuGraphExecDestroy(c_void_p(graph_exec))


def copy_to_host(address: int, size: int) -> bytes:
    buffer = ctypes.create_string_buffer(size)
    check(lib().cuMemcpyDtoH_v2(buffer, c_uint64(address), c_size_t(size)), "cuMemcpyDtoH")
    return buffer.raw


def copy_to_device(address: int, data: bytes) -> None:
    check(lib().cuMemcpyHtoD_v2(c_uint64(address), data, c_size_t(len(data))), "cuMemcpyHtoD")
