"""What one step's attention needs to know about the flattened batch: where each sequence's new tokens start,
how long each sequence is after the step, its block table, and the kernel's tile work list.

Its own module because the model runner builds it and both the PyTorch reference (runtime/engine/layers/attention.py)
and the Triton kernel (runtime/engine/kernels/paged_attention.py) read it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class SplitScratch:
    """Where the attention kernel's split parts meet (runtime/engine/kernels/paged_attention.py): each part's
    running max and sum, its unnormalised output, and a count of the parts arrived per program, which the
    last part sets back to zero. Sized for `max_programs` programs (tiles x KV heads) of up to `max_rows` rows
    and `max_dim` head dimensions; a call with more programs takes the kernel's single pass, one with larger
    tiles a kernel compiled without parts."""

    splits: int
    max_programs: int
    max_rows: int
    max_dim: int
    partial_ml: torch.Tensor   # [max_programs * splits * max_rows * 2] float32
    partial_acc: torch.Tensor  # [max_programs * splits * max_rows * max_dim] float32
    arrivals: torch.Tensor     # [max_programs] int32, zero between calls

    def fits(self, rows: int, dim: int) -> bool:
        return rows <= self.max_rows and dim <= self.max_dim


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
    # the kernel's scratch for splitting each tile's keys over several programs (cuda), or None
    split: SplitScratch | None = None
