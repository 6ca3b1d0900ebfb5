"""The decode CUDA graphs' inputs: the static device buffers the graphs read, and the host buffers each
step's inputs are staged in before they are copied there.

A decode step's inputs are a few hundred bytes, but building tensors from Python lists and copying them from
pageable memory (which the driver stages synchronously) cost the host more than a tenth of a millisecond per
step, during which the GPU waits. So the staging buffers are allocated once (pinned on cuda, so the copies are
asynchronous), and each step writes into them in place only what changed.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class DecodeBuffers:
    """Static inputs and outputs of the decode CUDA graphs (views of logged allocations)."""

    input_ids: torch.Tensor     # [max_bs] int64
    positions: torch.Tensor     # [max_bs] int64
    slot_mapping: torch.Tensor  # [max_bs] int64
    seq_lens: torch.Tensor      # [max_bs] int32
    block_tables: torch.Tensor  # [max_bs, max_blocks] int32
    arange: torch.Tensor        # [max_bs + 1] int32: query_start_loc, tile_seq and tile_q_start of a decode batch
    logits: torch.Tensor        # [max_bs, vocab] model dtype


_NO_BLOCKS: list[int] = []


class DecodeStaging:
    """Host copies of the per-step inputs of `decode`, filled in place each step and then copied there."""

    def __init__(self, decode: DecodeBuffers) -> None:
        pin = decode.input_ids.is_cuda
        targets = (decode.input_ids, decode.positions, decode.slot_mapping, decode.seq_lens, decode.block_tables)
        self._buffers = [(t, torch.zeros(t.shape, dtype=t.dtype, pin_memory=pin)) for t in targets]
        # numpy views: writing a list into a numpy slice costs a fraction of a torch indexing call
        self._ids, self._positions, self._slots, self._seq_lens, self._tables = (h.numpy() for _, h in self._buffers)
        # what each block-table row holds: the list it was written from and how many entries of it
        self._row_tables: list[list[int]] = [_NO_BLOCKS] * len(self._tables)
        self._row_widths: list[int] = [0] * len(self._tables)
        self._copies: dict[int, list[tuple[torch.Tensor, torch.Tensor]]] = {}
        # The copies read these buffers asynchronously, so a refill waits for the last ones. In the engine
        # they were queued before the last step's graph, which has usually finished by then (with async
        # scheduling it may still run: the wait is then until its inputs were copied, not until its end).
        self._copied = torch.cuda.Event() if pin else None

    def fill(self, bs: int, ids: list[int], positions: list[int], slots: list[int],
             tables: list[list[int]]) -> None:
        """Stage a decode step of len(ids) sequences (one new token each) padded to `bs` rows. Padding rows
        read token 0 at position 0, write slot 0 (the reserved block) and attend to that one slot."""
        if self._copied is not None:
            self._copied.synchronize()
        n = len(ids)
        self._ids[:n], self._ids[n:bs] = ids, 0
        self._positions[:n], self._positions[n:bs] = positions, 0
        self._slots[:n], self._slots[n:bs] = slots, 0
        self._seq_lens[:n], self._seq_lens[n:bs] = self._positions[:n] + 1, 1
        for i in range(bs):
            self._fill_table_row(i, tables[i] if i < n else _NO_BLOCKS)

    def _fill_table_row(self, i: int, table: list[int]) -> None:
        # A sequence's block table only grows at its end while it holds its blocks (BlockManager.grow
        # extends the list; free replaces it with a new one): the same list as last step needs only its
        # new entries written. The rows of one sequence's prompt tokens (after a cached prefix) share a list:
        # a row is copied from the one above, just written. Any other list is written whole, and what is left
        # of the old one zeroed.
        width, old_width = len(table), self._row_widths[i]
        if table is self._row_tables[i]:
            start = old_width
        elif i and table is self._row_tables[i - 1]:
            self._tables[i, :width] = self._tables[i - 1, :width]
            start = width
        else:
            start = 0
        if width > start:
            self._tables[i, start:width] = table[start:]
        if old_width > width:
            self._tables[i, width:old_width] = 0
        self._row_tables[i], self._row_widths[i] = table, width

    def upload(self, bs: int) -> None:
        """Start copying rows [0, bs) into the decode buffers (asynchronously on cuda)."""
        copies = self._copies.get(bs)
        if copies is None:  # slicing costs about a microsecond a tensor: once per batch size
            copies = self._copies[bs] = [(device[:bs], host[:bs]) for device, host in self._buffers]
        for device, host in copies:
            device.copy_(host, non_blocking=True)
        if self._copied is not None:
            self._copied.record()
