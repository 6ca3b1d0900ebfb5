"""Device memory whose physical pages can be given back and mapped again at the same address (CUDA's
virtual memory management API, through cuda-bindings).

The weight-less gpu snapshot needs it (snapshots/gpu.py): the weights live in a reserved address range;
before the CUDA checkpoint their pages are unmapped and released, so the image holds no weights; after the
restore new pages are mapped at the same addresses (the CUDA graphs and every parameter view keep pointing
at them) and the loader streams the weights back in.
"""

from __future__ import annotations

import threading
import time

import torch

from runtime.cuda_driver import DriverError, allocation_prop, call, granularity, map_range, reserve
from runtime.cuda_driver.device import use_device

#: how long `replace_adopted` waits for another process to free the memory it exported
REPLACE_WAIT_S = 10.0


class ReleasableBuffer:
    """A flat uint8 device buffer in its own reserved address range; `release()` frees its physical memory
    and keeps the range, `remap()` backs the range with new physical memory, `adopt()` with memory another
    process exported. ADOPT (descriptor, size): backed from the start by that exported memory instead of new."""

    def __init__(self, nbytes: int, device: torch.device, adopt: tuple[int, int] | None = None) -> None:
        from cuda.bindings import driver

        self._driver = driver
        self.device_index = device.index if device.index is not None else torch.cuda.current_device()
        self.nbytes = nbytes
        self._prop = allocation_prop(self.device_index)
        self.ptr, self.size = reserve(self._prop, nbytes)
        self._handle = None
        try:
            self.adopt(*adopt) if adopt is not None else self.remap()
        except DriverError:
            call(driver.cuMemAddressFree(self.ptr, self.size), "cuMemAddressFree")
            raise
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

    def replace_adopted(self, wait_s: float = REPLACE_WAIT_S) -> None:
        """New physical memory in place of adopted memory whose contents cannot be used (the exporting
        process's stream failed or it died). Its copies still in flight land on the old memory, never on the
        new. A device too full for both is retried for WAIT_S while that process frees its handle."""
        self.release()
        deadline = time.monotonic() + wait_s
        while True:
            try:
                self.remap()
                return
            except DriverError as exc:
                if "OUT_OF_MEMORY" not in str(exc) or time.monotonic() > deadline:
                    raise
                time.sleep(0.05)

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


class SpareMemory:
    """Physical memory unmapped from a MappedRange and not released yet, by size: a later `map` of the same size
    takes it instead of creating memory, and `release()` gives the rest to the driver (`release_later()`: on
    a thread of its own; a `release()` or the next `release_later()` waits for it). A multi-model pool keeps
    an eviction's memory here for the incoming model (runtime/pool/pool.py): on the H100 creating and
    releasing cost about as much as the mapping itself (scripts/probe_vmm.py)."""

    def __init__(self, device: torch.device) -> None:
        index = device.index if device.index is not None else torch.cuda.current_device()
        self._device = torch.device("cuda", index)  # for the release's thread, whose current GPU is the first
        self._lock = threading.Lock()  # the handles
        self._by_size: dict[int, list] = {}
        self.nbytes = 0
        self._releases = threading.Lock()  # one release at a time, whichever thread asks
        self._releasing: threading.Thread | None = None
        self._failed: BaseException | None = None

    def put(self, size: int, handle) -> None:
        with self._lock:
            self._by_size.setdefault(size, []).append(handle)
            self.nbytes += size

    def take(self, size: int):
        """A spare handle of SIZE bytes, or None."""
        with self._lock:
            handles = self._by_size.get(size)
            if not handles:
                return None
            self.nbytes -= size
            return handles.pop()

    def release(self) -> int:
        """Give every spare handle back to the driver, after a release in progress; returns the bytes."""
        with self._releases:
            self._wait()
            handles, freed = self._take_all()
            _release(handles)
        return freed

    def release_later(self) -> None:
        with self._releases:
            self._wait()
            handles, _ = self._take_all()
            if handles:
                self._releasing = threading.Thread(target=self._release_on_thread, args=(handles,),
                                                   name="spare-memory-release", daemon=True)
                self._releasing.start()

    def _take_all(self) -> tuple[list, int]:
        with self._lock:
            spare, self._by_size, freed, self.nbytes = self._by_size, {}, self.nbytes, 0
        return [h for handles in spare.values() for h in handles], freed

    def _release_on_thread(self, handles: list) -> None:
        try:
            use_device(self._device)
            _release(handles)
        except Exception as exc:  # raised by the next release, on the pool's side
            self._failed = exc

    def _wait(self) -> None:
        """Under the releases' lock."""
        if self._releasing is not None:
            self._releasing.join()
            self._releasing = None
        if self._failed is not None:
            failed, self._failed = self._failed, None
            raise failed


def _release(handles: list) -> None:
    from cuda.bindings import driver

    for handle in handles:
        call(driver.cuMemRelease(handle), "cuMemRelease")


class MappedRange:
    """A reserved device address range whose parts are backed separately: `map(parts)` puts physical memory
    under each part [start, end) of a list (granule-aligned), `unmap(parts)` gives that memory back (to
    SPARES, if given, else to the driver). The addresses never move, so views of the range (parameters, KV
    caches) and CUDA graphs that read it stay valid across an unmap and a map; what the part held is lost.
    A multi-model pool backs each model's weights and KV cache with one (runtime/pool)."""

    def __init__(self, nbytes: int, device: torch.device, spares: SpareMemory | None = None) -> None:
        from cuda.bindings import driver

        self._driver = driver
        self.device_index = device.index if device.index is not None else torch.cuda.current_device()
        self._prop = allocation_prop(self.device_index)
        self.ptr, self.size = reserve(self._prop, nbytes)
        self.granule = granularity(self._prop)
        self._handles: dict[int, tuple[int, object]] = {}  # start -> (end, handle)
        self._spares = spares
        self._device = device
        self._tensor: torch.Tensor | None = None

    @property
    def tensor(self) -> torch.Tensor:
        """A uint8 view of the whole range; made on first use, once the start of the range is mapped (torch
        asks the driver which device an address belongs to, and an unmapped one belongs to none)."""
        if self._tensor is None:
            self._tensor = torch.as_tensor(_CudaArray(self.ptr, self.size, self), device=self._device)
        return self._tensor

    def map(self, parts: list[tuple[int, int]]) -> None:
        """Put physical memory under each part [start, end) (whole granules), a spare handle of its size or
        new memory: all of them, or none if one fails (the driver's error is raised)."""
        for start, end in parts:
            if start % self.granule or end % self.granule or not 0 <= start < end <= self.size:
                raise DriverError(f"map: bytes {start}-{end} are not whole granules of a {self.size}-byte range")
        done: list[tuple[int, int]] = []
        try:
            for start, end in parts:
                handle = self._spares.take(end - start) if self._spares is not None else None
                handle = self._create(end - start) if handle is None else handle
                try:
                    map_range(self.ptr + start, end - start, handle, self.device_index)
                except DriverError:
                    call(self._driver.cuMemRelease(handle), "cuMemRelease")
                    raise
                self._handles[start] = (end, handle)
                done.append((start, end))
        except DriverError:
            self.unmap(done)
            raise

    def _create(self, size: int):
        try:
            return call(self._driver.cuMemCreate(size, self._prop, 0), "cuMemCreate")
        except DriverError:
            if self._spares is None or not self._spares.release():  # spares of other sizes may hold the room
                raise
            return call(self._driver.cuMemCreate(size, self._prop, 0), "cuMemCreate")

    def unmap(self, parts: list[tuple[int, int]]) -> None:
        """Give back the memory under each part, as it was mapped. Nothing may read the parts any more: the
        device is synchronised once, before the first."""
        for start, end in parts:
            mapped_end = self._handles.get(start, (None,))[0]
            if mapped_end != end:
                raise DriverError(f"unmap: bytes {start}-{end}, but {start}-{mapped_end} were mapped")
        if parts:
            torch.cuda.synchronize(self.device_index)
        for start, end in parts:
            _, handle = self._handles.pop(start)
            call(self._driver.cuMemUnmap(self.ptr + start, end - start), "cuMemUnmap")
            if self._spares is not None:
                self._spares.put(end - start, handle)
            else:
                call(self._driver.cuMemRelease(handle), "cuMemRelease")

    def close(self) -> None:
        self.unmap([(start, end) for start, (end, _) in self._handles.items()])
        call(self._driver.cuMemAddressFree(self.ptr, self.size), "cuMemAddressFree")
