"""Device memory whose physical pages can be given back and mapped again at the same address (CUDA's
virtual memory management API, through cuda-bindings).

The weight-less gpu snapshot needs it (snapshots/gpu.py): the weights live in a reserved address range;
before the CUDA checkpoint their pages are unmapped and released, so the image holds no weights; after the
restore new pages are mapped at the same addresses (the CUDA graphs and every parameter view keep pointing
at them) and the loader streams the weights back in.
"""

from __future__ import annotations

import torch

from runtime.cuda_driver import DriverError, allocation_prop, call, map_range, reserve


class ReleasableBuffer:
    """A flat uint8 device buffer in its own reserved address range; `release()` frees its physical memory
    and keeps the range, `remap()` backs the range with new physical memory, `adopt()` with memory another
    process exported."""

    def __init__(self, nbytes: int, device: torch.device) -> None:
        from cuda.bindings import driver

        self._driver = driver
        self.device_index = device.index if device.index is not None else torch.cuda.current_device()
        self.nbytes = nbytes
        self._prop = allocation_prop(self.device_index)
        self.ptr, self.size = reserve(self._prop, nbytes)
        self._handle = None
        self.remap()
        self.tensor = torch.as_tensor(_CudaArray(self.ptr, nbytes, self), device=device)

    @property
    def mapped(self) -> bool:
        return self._handle is not None

    def _map(self, handle) -> None:
        try:
            map_range(self.ptr, self.size, handle, self.device_index)
        except DriverError:
            call(self._driver.cuMemRelease(handle), "cuMemRelease")
            raise
        self._handle = handle

    def adopt(self, fd: int, size: int) -> None:
        """Back the reserved range with physical memory another process made and exported as a POSIX file
        descriptor (the CUDA restore helper, which filled it with the weights: snapshots/weights_during_restore.py).
        The caller still owns FD."""
        if self._handle is not None:
            raise DriverError("adopt: the range is already mapped")
        if size != self.size:
            raise DriverError(f"adopt: {size} bytes exported for a range of {self.size}")
        d = self._driver
        posix_fd = d.CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR
        self._map(call(d.cuMemImportFromShareableHandle(fd, posix_fd), "cuMemImportFromShareableHandle"))

    def remap(self) -> None:
        """Back the reserved range with new (uninitialised) physical memory."""
        if self._handle is not None:
            return
        self._map(call(self._driver.cuMemCreate(self.size, self._prop, 0), "cuMemCreate"))

    def release(self) -> None:
        """Give the physical memory back; the address range stays reserved. Nothing may touch the buffer
        until `remap()` (the device is synchronised first, so no kernel still reads it)."""
        if self._handle is None:
            return
        torch.cuda.synchronize(self.device_index)
        call(self._driver.cuMemUnmap(self.ptr, self.size), "cuMemUnmap")
        call(self._driver.cuMemRelease(self._handle), "cuMemRelease")
        self._handle = None


class _CudaArray:
    """What torch.as_tensor needs to view raw device memory without copying (it keeps this object, and so
    the buffer, alive as long as the tensor)."""

    def __init__(self, ptr: int, nbytes: int, owner: ReleasableBuffer) -> None:
        self.owner = owner
        self.__cuda_array_interface__ = {"shape": (nbytes,), "typestr": "|u1", "data": (ptr, False),
                                         "version": 3, "strides": None}
