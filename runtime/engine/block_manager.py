"""The paged KV cache's bookkeeping: which fixed-size blocks each sequence owns.

Block ids index the KV cache tensors (runtime/engine/model_runner.py). Blocks are handed out as a
sequence grows and returned when it finishes, is aborted or is preempted.
"""

from __future__ import annotations

from collections import deque

from runtime.engine.sequence import Sequence


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, reserved: int = 0) -> None:
        # The first `reserved` blocks are never handed out: padded rows of a CUDA graph batch write there.
        self.block_size = block_size
        self.num_blocks = num_blocks - reserved
        self._free: deque[int] = deque(range(reserved, num_blocks))

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_blocks - len(self._free)

    def blocks_needed(self, seq: Sequence, num_tokens: int) -> int:
        """Blocks to add so that `num_tokens` tokens of `seq` have a slot."""
        return max(0, -(-num_tokens // self.block_size) - len(seq.block_table))

    def can_grow(self, seq: Sequence, num_tokens: int) -> bool:
        return self.blocks_needed(seq, num_tokens) <= len(self._free)

    def grow(self, seq: Sequence, num_tokens: int) -> None:
        needed = self.blocks_needed(seq, num_tokens)
        if needed > len(self._free):
            raise RuntimeError("out of KV blocks (the scheduler should have preempted)")
        seq.block_table.extend(self._free.popleft() for _ in range(needed))

    def free(self, seq: Sequence) -> None:
        self._free.extend(seq.block_table)
        seq.block_table = []
        seq.num_computed_tokens = 0

    def slot(self, seq: Sequence, position: int) -> int:
        """The flat KV-cache slot of token `position` of `seq`."""
        return seq.block_table[position // self.block_size] * self.block_size + position % self.block_size
