"""Every long-lived device buffer of the engine comes from here, in a fixed order, and is logged.

The order and sizes are a pure function of (model, engine config, GPU type), which is what lets a
materialised CUDA graph name its buffers as (allocation index, offset) at bake time and find them again at
boot (snapshots/cudagraph). A multi-model pool (runtime/pool) hands the engine a `MemoryProvider`: the
buffers it provides (the weights, the KV cache) live in memory the pool can give back and map again at the
same addresses; nothing else in the engine allocates long-lived device memory.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Protocol

import torch

if TYPE_CHECKING:
    from runtime.engine.block_manager import KVCapacity


@dataclass(frozen=True)
class Allocation:
    index: int
    name: str
    nbytes: int
    ptr: int

    def as_dict(self) -> dict:
        return asdict(self)


class MemoryProvider(Protocol):
    def alloc(self, name: str, nbytes: int) -> torch.Tensor | None:
        """A flat uint8 buffer of at least `nbytes` for allocation NAME, or None: the allocator makes it."""

    def kv_capacity(self) -> "KVCapacity | None":
        """What backs the KV cache's blocks on demand (runtime/engine/block_manager.py), or None: all of
        them are backed from the start."""


class DeviceAllocator:
    def __init__(self, device: torch.device, provider: MemoryProvider | None = None) -> None:
        self.device = device
        self.provider = provider
        self.log: list[Allocation] = []
        self._buffers: list[torch.Tensor] = []
        self._releasable: dict = {}  # name -> ReleasableBuffer

    def alloc(self, name: str, nbytes: int, releasable: bool = False,
              adopt: tuple[int, int] | None = None) -> torch.Tensor:
        """A flat uint8 buffer of `nbytes`, kept alive for the engine's lifetime. A `releasable` one (CUDA
        only) can give its physical memory back and get new memory at the same address (runtime/engine/vmm.py).
        ADOPT (descriptor, size): releasable, backed by device memory another process exported (and filled)."""
        provided = self.provider.alloc(name, nbytes) if self.provider is not None else None
        if provided is not None:
            buffer = provided
        elif releasable or adopt is not None:
            from runtime.engine.vmm import ReleasableBuffer

            owner = ReleasableBuffer(nbytes, self.device, adopt)
            self._releasable[name] = owner
            buffer = owner.tensor
        else:
            buffer = torch.empty(max(nbytes, 1), dtype=torch.uint8, device=self.device)
        self.log.append(Allocation(len(self.log), name, nbytes, buffer.data_ptr()))
        self._buffers.append(buffer)
        return buffer

    def alloc_tensor(self, name: str, shape: tuple[int, ...], dtype: torch.dtype,
                     releasable: bool = False) -> torch.Tensor:
        numel = 1
        for n in shape:
            numel *= n
        nbytes = numel * torch.empty((), dtype=dtype).element_size()
        return self.alloc(name, nbytes, releasable)[:nbytes].view(dtype).view(shape)

    def release(self) -> int:
        """Free the physical memory of every releasable buffer (their addresses stay reserved and every view
        of them stays valid, unusable until `remap`). Returns the bytes given back."""
        for owner in self._releasable.values():
            owner.release()
        return sum(owner.size for owner in self._releasable.values())

    def remap(self, skip: tuple[str, ...] = ()) -> None:
        """New (uninitialised) physical memory under every released buffer but SKIP, at the same addresses."""
        for name, owner in self._releasable.items():
            if name not in skip:
                owner.remap()

    def releasable(self, name: str):
        """The ReleasableBuffer behind allocation NAME, or None."""
        return self._releasable.get(name)

    @property
    def released(self) -> bool:
        return any(not owner.mapped for owner in self._releasable.values())

    def buffer(self, index: int) -> torch.Tensor:
        return self._buffers[index]

    @property
    def driver_bytes(self) -> int:
        """Device memory of this allocator's buffers mapped through the driver, outside torch's allocator."""
        return sum(owner.size for owner in self._releasable.values() if owner.mapped)

    @property
    def total_bytes(self) -> int:
        return sum(a.nbytes for a in self.log)
