"""Memory whose parts can be given back and backed again at the same addresses: the CUDA one is
runtime/engine/vmm.py's MappedRange; on the host it is an anonymous mapping, where a part is given back with
madvise(MADV_DONTNEED) (the pages return to the OS at once; touching them again gives zero pages) and needs
no mapping before it is written."""

from __future__ import annotations

import mmap
from typing import Protocol

import torch


class Backing(Protocol):
    tensor: torch.Tensor  # flat uint8 over the whole range
    granule: int  # map and unmap take whole granules

    def map(self, parts: list[tuple[int, int]]) -> None: ...  # each part [start, end), whole granules
    def unmap(self, parts: list[tuple[int, int]]) -> None: ...
    def close(self) -> None: ...


class HostRange:
    def __init__(self, nbytes: int) -> None:
        self.granule = mmap.PAGESIZE
        self.size = -(-max(nbytes, 1) // self.granule) * self.granule
        self._map = mmap.mmap(-1, self.size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        self.tensor = torch.frombuffer(self._map, dtype=torch.uint8)

    def map(self, parts: list[tuple[int, int]]) -> None:
        pass  # pages are made when first written

    def unmap(self, parts: list[tuple[int, int]]) -> None:
        for start, end in parts:
            self._map.madvise(mmap.MADV_DONTNEED, start, end - start)

    def close(self) -> None:
        self._map.madvise(mmap.MADV_DONTNEED, 0, self.size)  # the tensor may outlive us; its pages need not


def make_backing(nbytes: int, device: torch.device, spares=None) -> Backing:
    """SPARES (runtime/engine/vmm.py's SpareMemory, CUDA only): where unmapped memory waits to be mapped again."""
    if device.type == "cuda":
        from runtime.engine.vmm import MappedRange

        return MappedRange(nbytes, device, spares)
    return HostRange(nbytes)
