"""Every long-lived device buffer of the engine comes from here, in a fixed order, and is logged.

The order and sizes are a pure function of (model, engine config, GPU type), which is what lets a
materialised CUDA graph name its buffers as (allocation index, offset) at bake time and find them again at
boot (snapshots/cudagraph). A later multi-model pool can implement `alloc` over one large arena that hands
out both weight and KV memory; nothing else in the engine allocates long-lived device memory.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch


@dataclass(frozen=True)
class Allocation:
    index: int
    name: str
    nbytes: int
    ptr: int

    def as_dict(self) -> dict:
        return asdict(self)


class DeviceAllocator:
    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.log: list[Allocation] = []
        self._buffers: list[torch.Tensor] = []

    def alloc(self, name: str, nbytes: int) -> torch.Tensor:
        """A flat uint8 buffer of `nbytes`, kept alive for the engine's lifetime."""
        buffer = torch.empty(max(nbytes, 1), dtype=torch.uint8, device=self.device)
        self.log.append(Allocation(len(self.log), name, nbytes, buffer.data_ptr()))
        self._buffers.append(buffer)
        return buffer

    def alloc_tensor(self, name: str, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        numel = 1
        for n in shape:
            numel *= n
        nbytes = numel * torch.empty((), dtype=dtype).element_size()
        return self.alloc(name, nbytes)[:nbytes].view(dtype).view(shape)

    def buffer(self, index: int) -> torch.Tensor:
        return self._buffers[index]

    @property
    def total_bytes(self) -> int:
        return sum(a.nbytes for a in self.log)
