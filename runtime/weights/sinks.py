"""Where the loader's bytes go (runtime/weights/loader.py): the weight buffer in host memory, a torch CUDA
buffer, or raw device memory through the driver API.

Every reader thread opens its own `Writer`. A piece that is not hashed on the host goes in with
`read_from(source, offset, dst, n)`: from a local file, through the native reader where it was built
(runtime/weights/native_reader.py; on a GPU through a ring of small pinned slots), else read from Python. A
piece hashed on the host is read into `slot(dst, n)`, hashed, then `commit(dst, n)`: on the host the slot
already is the buffer, on a GPU the piece is copied from a pinned slot on the writer's own stream. On a GPU
the event returned marks when the piece has landed. The driver sink exists for the CUDA restore helper,
which streams weights while CRIU restores the process and cannot afford to import torch (seconds) first
(snapshots/weights_during_restore.py).
"""

from __future__ import annotations

import ctypes
import os
import time
from typing import TYPE_CHECKING, Protocol

from runtime.cuda_driver import call
from runtime.cuda_driver.device import use_device
from runtime.weights.native_reader import Ring, native

if TYPE_CHECKING:
    import torch

    from runtime.weights.device_checksum import DeviceCheck
    from runtime.weights.manifest import Manifest


class Writer(Protocol):
    ring_s: float  # seconds its native reads' pinned ring took to make (0: none)

    def read_from(self, source, offset: int, dst: int, n: int) -> object | None: ...
    def slot(self, dst: int, n: int) -> memoryview: ...
    def commit(self, dst: int, n: int) -> object | None: ...
    def close(self) -> None: ...  # returns once every copy this writer made has landed


class Sink(Protocol):
    native: bool  # the native reader can serve this sink (built; on a GPU, libcuda found)

    def writer(self, slot_bytes: int, slots: int, ring_slot_bytes: int) -> Writer: ...  # 0: no native reads
    def wait_copies(self, events: list) -> None: ...
    def device_check(self, manifest: "Manifest", only: frozenset[int] | None = None) -> "DeviceCheck | None": ...


def check_bounds(dst: int, n: int, size: int) -> None:
    if dst < 0 or dst + n > size:
        raise ValueError(f"a write of bytes {dst}-{dst + n} past a {size}-byte buffer")


def read_staged(writer: Writer, source, offset: int, dst: int, n: int) -> object | None:
    """A piece read from Python into the writer's slot, then committed."""
    source.read_into(offset, writer.slot(dst, n))
    return writer.commit(dst, n)


class HostSink:
    """The buffer is host memory: pieces are read straight into it."""

    def __init__(self, buffer: "torch.Tensor") -> None:
        self._host = memoryview(buffer.numpy())
        self._address = buffer.data_ptr()
        self.native = native() is not None

    def writer(self, slot_bytes: int, slots: int, ring_slot_bytes: int) -> "_HostWriter":
        return _HostWriter(self._host, self._address if ring_slot_bytes else None)

    def wait_copies(self, events: list) -> None:
        pass

    def device_check(self, manifest: "Manifest", only: frozenset[int] | None = None) -> None:
        return None


class _HostWriter:
    ring_s = 0.0  # no ring: the pieces are read into the buffer

    def __init__(self, host: memoryview, native_address: int | None) -> None:
        self._host = host
        self._native_address = native_address  # where the native reader writes the buffer; None: from Python

    def read_from(self, source, offset: int, dst: int, n: int) -> None:
        check_bounds(dst, n, len(self._host))
        if self._native_address is None or source.tier != "disk":
            return read_staged(self, source, offset, dst, n)
        native().read_into(source, offset, n, self._native_address + dst)

    def slot(self, dst: int, n: int) -> memoryview:
        return self._host[dst:dst + n]

    def commit(self, dst: int, n: int) -> None:
        return None

    def close(self) -> None:
        pass


#: torch's host allocator pins by registering memory it has faulted in on several threads, instead of
#: cudaHostAlloc: in a fresh process on the H100 machine 16 readers' 16 MiB slots took 0.05 s instead of 0.21
PINNED_BY_REGISTERING = "pinned_use_cuda_host_register:True,pinned_num_register_threads:8"


def pin_by_registering() -> None:
    """Switch torch's pinned allocations to PINNED_BY_REGISTERING, unless PYTORCH_CUDA_ALLOC_CONF says how."""
    import torch

    if "pinned_" in os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "") + os.environ.get("PYTORCH_ALLOC_CONF", ""):
        return
    try:
        torch._C._accelerator_setAllocatorSettings(PINNED_BY_REGISTERING)
    except (AttributeError, RuntimeError):  # a torch without these options pins with cudaHostAlloc
        pass


class TorchCudaSink:
    """A torch CUDA buffer; pinned slots from torch's host allocator, one side stream per reader (one stream
    shared by every reader would make each wait behind the others' copies before reusing a slot)."""

    def __init__(self, buffer: "torch.Tensor") -> None:
        import torch

        pin_by_registering()
        self.buffer = buffer
        self._ready = torch.cuda.Event()  # whatever the caller queued on the buffer comes before the copies
        self._ready.record(torch.cuda.current_stream(buffer.device))
        reader = native()
        self.native = reader is not None and reader.cuda

    def writer(self, slot_bytes: int, slots: int, ring_slot_bytes: int) -> "_TorchCudaWriter":
        return _TorchCudaWriter(self, slot_bytes, slots, ring_slot_bytes)

    def wait_copies(self, events: list) -> None:
        """Make the caller's current stream wait for these copies."""
        import torch

        stream = torch.cuda.current_stream(self.buffer.device)
        for event in events:
            stream.wait_event(event)

    def device_check(self, manifest: "Manifest", only: frozenset[int] | None = None) -> "DeviceCheck":
        from runtime.weights.device_checksum import DeviceCheck

        return DeviceCheck(manifest, self.buffer, only=only)


class _TorchCudaWriter:
    """Pinned slots from torch's host allocator, each copied to the GPU on the writer's stream through the
    driver API, with one event per slot, recorded again for each piece it carries. Through torch (a tensor
    view, `copy_`, a new `torch.cuda.Event` and a stream context per piece) each piece held the GIL longer, and
    the loader was slower from the page cache. A piece's event, once recorded again, marks a later copy on the
    same stream, so waiting on it still waits for the piece. The native reader has a ring of its own, of
    `ring_slot_bytes` slots (0: none)."""

    def __init__(self, sink: TorchCudaSink, slot_bytes: int, slots: int, ring_slot_bytes: int) -> None:
        import torch
        from cuda.bindings import driver

        self._torch, self._d = torch, driver
        self._base = sink.buffer.data_ptr()
        self._end = self._base + sink.buffer.numel()
        use_device(sink.buffer.device)  # a reader thread may have worked for another GPU before
        self._stream = torch.cuda.Stream(sink.buffer.device)
        self._stream.wait_event(sink._ready)
        self._handle = self._stream.cuda_stream
        self._slot_bytes = slot_bytes
        # each slot pinned on first use, so a reader starts after one slot rather than its whole ring: with
        # cudaHostAlloc a fresh process pinned ~0.6 ms per MiB, one allocation at a time (H100 machine: 0.31 s
        # for 16 readers' 32 MiB rings)
        self._slots: list[list] = [[None, None, torch.cuda.Event(), False] for _ in range(slots)]
        self._turn = 0
        self._ring_shape = (slots, ring_slot_bytes)
        self._ring = None  # made on the first piece read natively
        self._ring_events: list = []
        self.ring_s = 0.0

    def read_from(self, source, offset: int, dst: int, n: int) -> object:
        if not self._ring_shape[1] or source.tier != "disk":
            return read_staged(self, source, offset, dst, n)
        check_bounds(dst, n, self._end - self._base)
        if self._ring is None:
            started = time.time()
            self._ring = self._make_ring(*self._ring_shape)
            self.ring_s = time.time() - started
        native().read_to_device(source, offset, n, self._base + dst, self._ring)
        return self._ring_events[self._ring.last]

    def _make_ring(self, slots: int, slot_bytes: int) -> Ring:
        self._ring_memory = self._torch.empty(slots * slot_bytes, dtype=self._torch.uint8, pin_memory=True)
        self._ring_events = [self._torch.cuda.Event() for _ in range(slots)]
        for event in self._ring_events:
            event.record(self._stream)  # torch creates an event's CUevent when it is first recorded
        base = self._ring_memory.data_ptr()
        return Ring.over([base + k * slot_bytes for k in range(slots)], [e.cuda_event for e in self._ring_events],
                         slot_bytes, self._handle)

    def slot(self, dst: int, n: int) -> memoryview:
        slot = self._slots[self._turn % len(self._slots)]
        if slot[0] is None:
            slot[0] = self._torch.empty(self._slot_bytes, dtype=self._torch.uint8, pin_memory=True)
            slot[1] = memoryview(slot[0].numpy())
        elif slot[3]:
            slot[2].synchronize()  # the slot's previous copy has left it
        return slot[1][:n]

    def commit(self, dst: int, n: int) -> object:
        slot = self._slots[self._turn % len(self._slots)]
        self._turn += 1
        check_bounds(dst, n, self._end - self._base)
        call(self._d.cuMemcpyHtoDAsync(self._base + dst, slot[0].data_ptr(), n, self._handle), "cuMemcpyHtoDAsync")
        slot[2].record(self._stream)
        slot[3] = True
        return slot[2]

    def close(self) -> None:
        """Wait for this writer's last copies: torch's host allocator does not know of them, and would hand
        a slot to another reader while the GPU still reads it. The slots go back to torch's cache then (a
        frozen runtime empties it, snapshots/frozen.py)."""
        for slot in self._slots:
            if slot[3]:
                slot[2].synchronize()
        for event in self._ring_events:
            event.synchronize()


class DriverSink:
    """`nbytes` of device memory at `ptr` in the current CUDA context, written through cuda-bindings (no
    torch). `commit` returns no event: the owner waits for the whole load (each writer's close() drains its
    stream)."""

    native = False  # the helper hashes every piece on the host (no device checksums without torch): staged

    def __init__(self, ptr: int, nbytes: int, context) -> None:
        self.ptr = ptr
        self.nbytes = nbytes
        self.context = context

    def writer(self, slot_bytes: int, slots: int, ring_slot_bytes: int) -> "_DriverWriter":
        return _DriverWriter(self, slot_bytes, slots)

    def wait_copies(self, events: list) -> None:
        pass

    def device_check(self, manifest: "Manifest", only: frozenset[int] | None = None) -> None:
        return None  # no torch or Triton in the restore helper: its chunks are hashed on the host


class _DriverWriter:
    ring_s = 0.0  # read from Python into slots pinned when the writer is made

    def __init__(self, sink: DriverSink, slot_bytes: int, slots: int) -> None:
        from cuda.bindings import driver

        self._d = driver
        self._sink = sink
        call(driver.cuCtxSetCurrent(sink.context), "cuCtxSetCurrent")
        self._stream = call(driver.cuStreamCreate(driver.CUstream_flags.CU_STREAM_NON_BLOCKING), "cuStreamCreate")
        self._host = int(call(driver.cuMemHostAlloc(slot_bytes * slots, 0), "cuMemHostAlloc"))
        whole = (ctypes.c_char * (slot_bytes * slots)).from_address(self._host)
        view = memoryview(whole).cast("B")
        self._slots = [(self._host + k * slot_bytes, view[k * slot_bytes:(k + 1) * slot_bytes],
                        call(driver.cuEventCreate(driver.CUevent_flags.CU_EVENT_DISABLE_TIMING), "cuEventCreate"),
                        [False]) for k in range(slots)]
        self._turn = 0

    def read_from(self, source, offset: int, dst: int, n: int) -> None:
        return read_staged(self, source, offset, dst, n)

    def slot(self, dst: int, n: int) -> memoryview:
        _, view, event, pending = self._slots[self._turn % len(self._slots)]
        if pending[0]:
            call(self._d.cuEventSynchronize(event), "cuEventSynchronize")
        return view[:n]

    def commit(self, dst: int, n: int) -> None:
        d = self._d
        check_bounds(dst, n, self._sink.nbytes)
        host, _, event, pending = self._slots[self._turn % len(self._slots)]
        self._turn += 1
        call(d.cuMemcpyHtoDAsync(self._sink.ptr + dst, host, n, self._stream), "cuMemcpyHtoDAsync")
        call(d.cuEventRecord(event, self._stream), "cuEventRecord")
        pending[0] = True
        return None

    def close(self) -> None:
        d = self._d
        call(d.cuStreamSynchronize(self._stream), "cuStreamSynchronize")
        for _, _, event, _ in self._slots:
            d.cuEventDestroy(event)
        d.cuStreamDestroy(self._stream)
        d.cuMemFreeHost(self._host)
