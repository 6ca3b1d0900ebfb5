"""The loader's reads in C (runtime/weights/native_reader.c, built by `pip install` as the shared library
runtime/weights/_native_reader*.so): a piece is read, and on a GPU copied through a ring of small pinned
slots, in one call that holds no GIL.

Built as an optional extension: where it could not be built (no C compiler at install), `native()` is None,
says why once, and the loader reads from Python (slower on a GPU: docs/weights.md).
"""

from __future__ import annotations

import ctypes
import functools
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING

from runtime.logs import get_logger
from runtime.native_library import open_built
from runtime.weights.errors import WeightsError

if TYPE_CHECKING:
    from runtime.weights.sources import LocalFile

log = get_logger("weights.native_reader")

END_OF_FILE, CUDA_FAILED = 1, 2
MAX_SLOTS = 8


class Ring(ctypes.Structure):
    """struct thaw_ring: one reader's pinned slots, their events, and where it is in them."""

    _fields_ = [("slots", ctypes.c_void_p * MAX_SLOTS), ("events", ctypes.c_void_p * MAX_SLOTS),
                ("pending", ctypes.c_int * MAX_SLOTS), ("n_slots", ctypes.c_int), ("slot_bytes", ctypes.c_longlong),
                ("turn", ctypes.c_longlong), ("stream", ctypes.c_void_p), ("last", ctypes.c_int),
                ("cuda_error", ctypes.c_int)]

    @classmethod
    def over(cls, slots: list[int], events: list[int], slot_bytes: int, stream: int) -> "Ring":
        """A ring of these slot addresses (slot_bytes each) and CUevent handles, copying on `stream`."""
        if not 0 < len(slots) <= MAX_SLOTS or len(events) != len(slots):
            raise ValueError(f"a ring has 1 to {MAX_SLOTS} slots, each with an event")
        ring = cls(n_slots=len(slots), slot_bytes=slot_bytes, stream=stream)
        ring.slots[:len(slots)] = slots
        ring.events[:len(events)] = events
        return ring


@dataclass(frozen=True)
class NativeReader:
    lib: ctypes.CDLL
    cuda: bool  # libcuda was found: read_to_device works

    def read_into(self, source: "LocalFile", offset: int, n: int, address: int) -> None:
        """`n` bytes at `offset` of the file into host memory at `address`."""
        self._check(self.lib.thaw_read(source.fd, offset, n, address), source, offset + n)

    def read_to_device(self, source: "LocalFile", offset: int, n: int, device_address: int, ring: Ring) -> None:
        """`n` bytes at `offset` of the file to `device_address` through `ring`; returns once the last copy is
        queued on the ring's stream (the event at `ring.last` marks it)."""
        self._check(self.lib.thaw_read_to_device(source.fd, offset, n, device_address, ctypes.byref(ring)),
                    source, offset + n, ring)

    @staticmethod
    def _check(status: int, source: "LocalFile", end: int, ring: Ring | None = None) -> None:
        if status == 0:
            return
        if status == END_OF_FILE:
            raise WeightsError(f"{source.path}: truncated ({source.size} bytes, needed {end})")
        if status == CUDA_FAILED:
            raise WeightsError(f"{source.path}: a copy to the GPU failed (CUresult {ring.cuda_error})")
        raise OSError(-status, os.strerror(-status), str(source.path))


@functools.cache
def native() -> NativeReader | None:
    """The built library, or None (said once in the log, with the reason)."""
    return _load()


def _load() -> NativeReader | None:
    lib = open_built("runtime.weights._native_reader", "the native reader", "weights are read from Python", log)
    if lib is None:
        return None
    lib.thaw_read.argtypes = [ctypes.c_int, ctypes.c_longlong, ctypes.c_longlong, ctypes.c_void_p]
    lib.thaw_read_to_device.argtypes = [ctypes.c_int, ctypes.c_longlong, ctypes.c_longlong, ctypes.c_ulonglong,
                                        ctypes.POINTER(Ring)]
    return NativeReader(lib, cuda=lib.thaw_cuda_init() == 0)
