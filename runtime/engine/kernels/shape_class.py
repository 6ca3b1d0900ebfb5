"""Kernel reuse by shape class: each Triton kernel is compiled for a class of shapes, not for one model's.

A model's sizes (hidden size, head counts, the query heads per KV head) are runtime arguments of the kernels,
and the compile-time block sizes are chosen per class, so that models of different sizes launch the same
compiled kernel: a model whose classes another model of the process already loaded loads no Triton kernel
at its first start (PASK's reuse of loaded kernels, decided ahead: docs/multi-model.md, "Kernels"). The
attention is one class for every head dimension of 128 (Qwen2, Qwen3, Llama-3, Mistral), whatever the
heads per KV head; the norms take a hidden size up to 2,048 in one class and up to 4,096 in the next, the
rotary with the KV write up to 16 heads and up to 32.

The classes are fixed rather than picked at run time among the kernels already loaded, because a
materialised CUDA graph names its kernels (snapshots/cudagraph): the kernel a model launches must be the
one it was baked with, whatever else the process loaded before it. A masked lane costs instructions, not
memory accesses: with these classes the decode steps are 0.6-2.2% slower than with a kernel per model shape
(docs/benchmarks.md, "Decode throughput").
"""

from __future__ import annotations

# The smallest class of the norms and the rotary is not the largest common size: one at 4,096 (and 32
# heads) made Qwen2-1.5B's decode steps 2.7-2.9% slower on the H100 (scripts/bench_decode_two_trees.sh), for
# two kernels loaded once per process
ROW_CLASS = 2048  # norms: hidden sizes
HEADS_CLASS = 16  # rotary and KV write: the larger of the query and KV head counts
HALF_CLASS = 64  # rotary and KV write: half the head dimension
PREFILL_ROWS = 64  # prefill attention: query rows (tokens x heads of a group) per tile


def row_block(size: int) -> int:
    return max(ROW_CLASS, _power_of_2(size))


def row_warps(block: int) -> int:
    return 8 if block > 2048 else 4


def heads_block(heads: int) -> int:
    return max(HEADS_CLASS, _power_of_2(heads))


def half_block(half: int) -> int:
    return max(HALF_CLASS, _power_of_2(half))


def prefill_block_q(group: int) -> int:
    """Query tokens per prefill tile: as many as fill PREFILL_ROWS rows with a GROUP of heads each, so that
    every model with that many rows or fewer per group launches the same attention kernel."""
    return max(1, PREFILL_ROWS // group)


def _power_of_2(n: int) -> int:
    # not triton's: the CPU path imports this module (the prefill tiles) and must not import Triton
    return 1 << max(0, n - 1).bit_length()
