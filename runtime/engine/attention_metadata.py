"""What one step's attention needs to know about the flattened batch: where each sequence's new tokens start,
how long each sequence is after the step, its block table, and the kernel's tile work list.

Its own module because the model runner builds it and both the PyTorch reference (runtime/engine/layers/attention.py)
and the Triton kernel (runtime/engine/kernels/paged_attention.py) read it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor      # [T] int64: the KV-cache slot each new token is written to
    query_start_loc: torch.Tensor   # [B + 1] int32
    seq_lens: torch.Tensor          # [B] int32: tokens in the cache after this step, per sequence
    block_tables: torch.Tensor      # [B, max_blocks] int32
    # The kernel's work list: one tile of at most `block_q` query tokens of one sequence each.
    tile_seq: torch.Tensor          # [tiles] int32
    tile_q_start: torch.Tensor      # [tiles] int32: first flattened token index of the tile
    block_q: int
    # host copies, for the cpu reference
    query_start_loc_cpu: list[int] | None = None
    seq_lens_cpu: list[int] | None = None
    # the cpu attention's gather plan of a decode batch, made by its first layer and reused by the others
    cpu_decode_plan: object | None = None
    # the cpu attention's first block of each sequence whose blocks are consecutive (else None), likewise
    cpu_first_blocks: list[int | None] | None = None
