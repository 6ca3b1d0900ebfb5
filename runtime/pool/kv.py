"""A model's KV cache in the pool, backed on demand in chunks of blocks.

The cache is [layers, 2, blocks, block_size, kv_heads, head_dim] (runtime/engine/model_runner.py): one
plane per (layer, keys or values), each contiguous over the blocks, which is what the attention kernels
index. So a chunk of blocks is not one byte range: it is backed as one range in every plane. A chunk is the
fewest blocks whose range in a plane is whole granules (on the H100, 2 MiB: 64 blocks of Llama-3-8B, 1024
tokens; 256 of Qwen2-1.5B), and the cache holds a whole number of chunks, so every plane starts on a
granule. The first chunk is backed whenever the model may run: padded rows of a CUDA graph batch write its
block 0.
"""

from __future__ import annotations

import math
import time

import torch

from runtime.pool.backing import Backing


class KVMemory:
    def __init__(self, engine, granule: int) -> None:
        c, config = engine.model_config, engine.config
        itemsize = torch.empty((), dtype=getattr(torch, config.dtype)).element_size()
        self.block_plane_bytes = config.block_size * c.num_kv_heads * c.head_dim * itemsize
        self.planes = c.num_layers * 2
        self.block_bytes = self.planes * self.block_plane_bytes
        self.chunk_blocks = math.lcm(granule, self.block_plane_bytes) // self.block_plane_bytes
        self.chunk_bytes = self.chunk_blocks * self.block_bytes
        self.per_sequence = -(-engine.max_model_len // config.block_size)
        self.wanted_blocks = config.max_num_seqs * self.per_sequence + 1
        self.num_blocks = 0  # of the cache, fixed at the first start (size())
        self.mapped_chunks = 0
        self.backing: Backing | None = None
        self.map_bytes_per_s = 0.0  # how fast its last chunks were backed (0: not yet)

    def least_bytes(self) -> int:
        """One full-length sequence and the reserved block, in whole chunks."""
        return self.chunks_for(self.per_sequence + 1) * self.chunk_bytes

    def chunks_for(self, blocks: int) -> int:
        return -(-blocks // self.chunk_blocks)

    def size(self) -> int:
        """Fix the cache's blocks: what max_num_seqs full-length sequences need, in whole chunks. Only an
        address range: memory comes chunk by chunk. It depends on the engine's settings alone, not on the
        pool, so that materialised CUDA graphs baked for it find the same allocations at boot."""
        self.num_blocks = self.chunks_for(self.wanted_blocks) * self.chunk_blocks
        return self.num_blocks

    @property
    def num_chunks(self) -> int:
        return self.num_blocks // self.chunk_blocks

    @property
    def mapped_bytes(self) -> int:
        return self.mapped_chunks * self.chunk_bytes

    def map_chunks(self, count: int) -> None:
        """Back the first COUNT chunks (those not backed yet)."""
        count = min(count, self.num_chunks)
        if count > self.mapped_chunks:
            began = time.perf_counter()
            self.backing.map(self._parts(self.mapped_chunks, count))
            seconds = time.perf_counter() - began
            self.map_bytes_per_s = (count - self.mapped_chunks) * self.chunk_bytes / max(seconds, 1e-9)
            self.mapped_chunks = count

    def unmap_from(self, keep: int) -> int:
        """Give back every chunk past the first KEEP; returns the bytes."""
        if keep >= self.mapped_chunks:
            return 0
        freed = (self.mapped_chunks - keep) * self.chunk_bytes
        self.backing.unmap(self._parts(keep, self.mapped_chunks))
        self.mapped_chunks = keep
        return freed

    def _parts(self, first: int, end: int) -> list[tuple[int, int]]:
        """Chunks FIRST to END (excluded), each a part in every plane (a chunk is backed and given back on
        its own)."""
        plane = self.num_blocks * self.block_plane_bytes
        step = self.chunk_blocks * self.block_plane_bytes
        return [(p * plane + c * step, p * plane + (c + 1) * step)
                for c in range(first, end) for p in range(self.planes)]
