"""The paged KV cache's bookkeeping: which fixed-size blocks each sequence owns.

Block ids index the KV cache tensors (runtime/engine/model_runner.py). Blocks are handed out as a
sequence grows and returned when it finishes, is aborted or is preempted.

Under a multi-model pool (runtime/pool) the cache's memory comes on demand: only the blocks below
`usable` are backed, and when none of them is free the manager asks its `KVCapacity` for more (the pool
backs more of the cache, giving back retained weights of idle models if it must); when it gets none, the
scheduler preempts as it does with a fixed cache. `give_back()` returns every block of an idle engine.
"""

from __future__ import annotations

from collections import deque
from typing import Protocol

from runtime.engine.sequence import Sequence


class KVCapacity(Protocol):
    def grant(self, usable: int, wanted: int) -> int:
        """Try to back WANTED more blocks than the USABLE first ones; returns how many first blocks are backed
        now (at least USABLE)."""


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, reserved: int = 0,
                 capacity: KVCapacity | None = None) -> None:
        # The first `reserved` blocks are never handed out: padded rows of a CUDA graph batch write there.
        self.block_size = block_size
        self.num_blocks = num_blocks - reserved
        self._reserved = reserved
        self._capacity = capacity
        self._usable = num_blocks if capacity is None else reserved
        self._free: deque[int] = deque(range(reserved, self._usable))

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self._usable - self._reserved - len(self._free)

    def _have_free(self, needed: int) -> bool:
        if needed > len(self._free) and self._capacity is not None:
            usable = min(self._capacity.grant(self._usable, needed - len(self._free)), self.num_blocks + self._reserved)
            self._free.extend(range(self._usable, usable))
            self._usable = max(self._usable, usable)
        return needed <= len(self._free)

    def give_back(self) -> None:
        """Stop using every block (their memory is about to be given back): only when none is held."""
        if self.num_used:
            raise RuntimeError(f"{self.num_used} KV blocks are still held")
        self._free.clear()
        self._usable = self._reserved

    def blocks_needed(self, seq: Sequence, num_tokens: int) -> int:
        """Blocks to add so that `num_tokens` tokens of `seq` have a slot."""
        return max(0, -(-num_tokens // self.block_size) - len(seq.block_table))

    def can_grow(self, seq: Sequence, num_tokens: int) -> bool:
        return self._have_free(self.blocks_needed(seq, num_tokens))

    def grow(self, seq: Sequence, num_tokens: int) -> None:
        needed = self.blocks_needed(seq, num_tokens)
        if not self._have_free(needed):
            raise RuntimeError("out of KV blocks (the scheduler should have preempted)")
        seq.block_table.extend(self._free.popleft() for _ in range(needed))

    def free(self, seq: Sequence) -> None:
        self._free.extend(seq.block_table)
        seq.block_table = []
        seq.num_computed_tokens = 0

    def slot(self, seq: Sequence, position: int) -> int:
        """The flat KV-cache slot of token `position` of `seq`."""
        return seq.block_table[position // self.block_size] * self.block_size + position % self.block_size
