"""The one Python binding to the CUDA driver, without torch. Here, through cuda-bindings: checking a call's
result, the virtual memory pieces shared by the engine's releasable buffers (runtime/engine/vmm.py) and the
CUDA restore helper's exportable memory (snapshots/weights_during_restore.py), and the context's stack limit
(released around a gpu snapshot's checkpoint, snapshots/frozen.py). In `graphs`, through ctypes: the calls a
CUDA graph's description and rebuild make thousands of times (snapshots/cudagraph). The loader's native
reader (runtime/weights/native_reader.c) opens libcuda from C for its copies."""

from __future__ import annotations


def bindings_installed() -> bool:
    """Whether cuda-bindings can be imported here (looked up, not imported)."""
    import importlib.util

    try:
        return importlib.util.find_spec("cuda.bindings") is not None
    except ModuleNotFoundError:  # no `cuda` package at all
        return False


def import_bindings() -> None:
    """Import cuda-bindings' driver module where it is cheap: in the engine's CPU phase, which a process
    snapshot holds, not at the device phase's first driver call (17-30 ms of a restored runtime's start on
    the H200 machine: its extension module's set-up and enums). The import neither loads nor initialises
    the driver."""
    if bindings_installed():
        from cuda.bindings import driver  # noqa: F401


class DriverError(RuntimeError):
    """A driver call failed; the message names the call and the driver's error."""


def call(result: tuple, name: str):
    """The value of a cuda-bindings call (its first element is the CUresult), or DriverError naming it."""
    from cuda.bindings import driver

    err = result[0]
    if err != driver.CUresult.CUDA_SUCCESS:
        _, text = driver.cuGetErrorName(err)
        raise DriverError(f"{name}: {text.decode() if isinstance(text, bytes) else text}")
    return result[1] if len(result) == 2 else (result[1:] if len(result) > 2 else None)


def allocation_prop(device: int, exportable: bool = False):
    """Properties of pinned device memory on DEVICE; EXPORTABLE: shareable as a POSIX file descriptor."""
    from cuda.bindings import driver as d

    prop = d.CUmemAllocationProp()
    prop.type = d.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED
    prop.location.type = d.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
    prop.location.id = device
    if exportable:
        prop.requestedHandleTypes = d.CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR
    return prop


def granularity(prop) -> int:
    """The recommended granularity of mappings of PROP's memory (2 MiB on the H100)."""
    from cuda.bindings import driver as d

    recommended = d.CUmemAllocationGranularity_flags.CU_MEM_ALLOC_GRANULARITY_RECOMMENDED
    return int(call(d.cuMemGetAllocationGranularity(prop, recommended), "cuMemGetAllocationGranularity"))


def reserve(prop, nbytes: int) -> tuple[int, int]:
    """(address, size) of a reserved range for NBYTES, the size rounded up to the recommended granularity:
    a releasable range and the memory exported for it are sized alike."""
    from cuda.bindings import driver as d

    step = granularity(prop)
    size = -(-max(nbytes, 1) // step) * step
    return int(call(d.cuMemAddressReserve(size, step, 0, 0), "cuMemAddressReserve")), size


def map_range(ptr: int, size: int, handle, device: int) -> None:
    """Map HANDLE's physical memory at PTR, readable and writable from DEVICE."""
    from cuda.bindings import driver as d

    call(d.cuMemMap(ptr, size, 0, handle, 0), "cuMemMap")
    access = d.CUmemAccessDesc()
    access.location.type = d.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
    access.location.id = device
    access.flags = d.CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_READWRITE
    call(d.cuMemSetAccess(ptr, size, [access], 1), "cuMemSetAccess")


def stack_limit(value: int | None = None) -> int:
    """The current context's per-thread stack size in bytes, after setting it to VALUE if given."""
    from cuda.bindings import driver as d

    limit = d.CUlimit.CU_LIMIT_STACK_SIZE
    if value is not None:
        call(d.cuCtxSetLimit(limit, value), "cuCtxSetLimit")
    return int(call(d.cuCtxGetLimit(limit), "cuCtxGetLimit"))
