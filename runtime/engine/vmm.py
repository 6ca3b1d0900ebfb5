"""Device memory whose physical pages can be given back and mapped again at the same address (CUDA's
virtual memory management API, through cuda-bindings).

The weight-less gpu snapshot needs it (snapshots/gpu.py): the weights live in a reserved address range;
before the CUDA checkpoint their pages are unmapped and released, so the image holds no weights; after the
restore new pages are mapped at the same addresses (the CUDA graphs and every parameter view keep pointing
at them) and the loader streams the weights back in.
"""

from __future__ import annotations

import torch


class VmmError(RuntimeError):
    pass


class ReleasableBuffer:
    """A flat uint8 device buffer in its own reserved address range; `release()` frees its physical memory
    and keeps the range, `remap()` backs the range with new physical memory."""

    def __init__(self, nbytes: int, device: torch.device) -> None:
        from cuda.bindings import driver

        self._driver = driver
        self.device_index = device.index if device.index is not None else torch.cuda.current_device()
        self.nbytes = nbytes
        self._prop = driver.CUmemAllocationProp()
        self._prop.type = driver.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED
        self._prop.location.type = driver.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
        self._prop.location.id = self.device_index
        granularity = self._call("cuMemGetAllocationGranularity", self._prop,
                                 driver.CUmemAllocationGranularity_flags.CU_MEM_ALLOC_GRANULARITY_RECOMMENDED)
        self.size = -(-max(nbytes, 1) // granularity) * granularity
        self.ptr = int(self._call("cuMemAddressReserve", self.size, granularity, 0, 0))
        self._handle = None
        self.remap()
        self.tensor = torch.as_tensor(_CudaArray(self.ptr, nbytes, self), device=device)

    @property
    def mapped(self) -> bool:
        return self._handle is not None

    def _map(self, handle) -> None:
        d = self._driver
        try:
            self._call("cuMemMap", self.ptr, self.size, 0, handle, 0)
        except VmmError:
            self._call("cuMemRelease", handle)
            raise
        access = d.CUmemAccessDesc()
        access.location.type = d.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
        access.location.id = self.device_index
        access.flags = d.CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_READWRITE
        self._call("cuMemSetAccess", self.ptr, self.size, [access], 1)
        self._handle = handle

    def adopt(self, fd: int, size: int) -> None:
        """Back the reserved range with physical memory another process made and exported as a POSIX file
        descriptor (the CUDA restore helper, which filled it with the weights: snapshots/weights_during_restore.py).
        The caller still owns FD."""
        if self._handle is not None:
            raise VmmError("adopt: the range is already mapped")
        if size != self.size:
            raise VmmError(f"adopt: {size} bytes exported for a range of {self.size}")
        d = self._driver
        handle = self._call("cuMemImportFromShareableHandle", fd,
                            d.CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR)
        self._map(handle)

    def remap(self) -> None:
        """Back the reserved range with new (uninitialised) physical memory."""
        if self._handle is not None:
            return
        self._map(self._call("cuMemCreate", self.size, self._prop, 0))

    def release(self) -> None:
        """Give the physical memory back; the address range stays reserved. Nothing may touch the buffer
        until `remap()` (the device is synchronised first, so no kernel still reads it)."""
        if self._handle is None:
            return
        torch.cuda.synchronize(self.device_index)
        self._call("cuMemUnmap", self.ptr, self.size)
        self._call("cuMemRelease", self._handle)
        self._handle = None

    def _call(self, name: str, *args):
        result = getattr(self._driver, name)(*args)
        err = result[0]
        if err != self._driver.CUresult.CUDA_SUCCESS:
            _, text = self._driver.cuGetErrorName(err)
            raise VmmError(f"{name}: {text.decode() if isinstance(text, bytes) else text}")
        return result[1] if len(result) == 2 else result[1:]


class _CudaArray:
    """What torch.as_tensor needs to view raw device memory without copying (it keeps this object, and so
    the buffer, alive as long as the tensor)."""

    def __init__(self, ptr: int, nbytes: int, owner: ReleasableBuffer) -> None:
        self.owner = owner
        self.__cuda_array_interface__ = {"shape": (nbytes,), "typestr": "|u1", "data": (ptr, False),
                                         "version": 3, "strides": None}
