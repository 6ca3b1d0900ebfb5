"""Triton paged attention for prefill, decode and mixed batches (one kernel for all three).

Each program handles one tile — up to BLOCK_Q query tokens of one sequence — for one KV head, with all the
query heads that share that KV head (grouped-query attention) stacked as rows, so a KV tile is loaded once
per group. Keys and values are gathered from the paged cache through the sequence's block table, in tiles
of BLOCK_N positions, with an online softmax; causality is per row (each query token sees the positions up
to its own). The plain PyTorch reference in runtime/engine/layers/attention.py is what this is tested against.

Split keys: with few programs (a decode batch of a few sequences, the rows of a question after a long cached
prefix) each program would walk thousands of keys alone while most of the GPU idles. Then each tile's keys are
cut into parts, one program each (the grid's third dimension), that write their running max, sum and
unnormalised output to scratch (`SplitScratch`); the part that finishes last (an atomic count per tile and KV
head) merges them and writes the output, in the same launch, so a CUDA graph gains no kernel.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from runtime.engine.attention_metadata import AttentionMetadata
from runtime.engine.kernels.dependent_launch import launch_options, wait_for_previous

BLOCK_N = 64


# The group (query heads per KV head) and the tile's query tokens are runtime arguments, unspecialised: the
# compiled kernel is one per shape class (BLOCK_M rows, the head dimension), shared by every model of that
# class (runtime/engine/kernels/shape_class.py)
@triton.jit(do_not_specialize=["group", "block_q", "early"])
def _paged_attention_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, out_ptr,
    tile_seq_ptr, tile_q_start_ptr, query_start_ptr, seq_lens_ptr, block_tables_ptr,
    partial_ml_ptr, partial_acc_ptr, arrivals_ptr,
    scale,
    stride_qt, stride_qh, stride_ot, stride_oh, stride_kslot, stride_kh, stride_vslot, stride_vh, stride_bt,
    group, block_q, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, KV_BLOCK_SIZE: tl.constexpr, PRECISION: tl.constexpr,
    CAN_SPLIT: tl.constexpr, early, PDL: tl.constexpr,
):
    wait_for_previous(early, PDL)
    tile = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    seq = tl.load(tile_seq_ptr + tile)
    q_start = tl.load(tile_q_start_ptr + tile)
    seq_q_start = tl.load(query_start_ptr + seq)
    seq_q_end = tl.load(query_start_ptr + seq + 1)
    seq_len = tl.load(seq_lens_ptr + seq)
    first_position = seq_len - (seq_q_end - seq_q_start)

    rows = tl.arange(0, BLOCK_M)
    token = q_start + rows // group
    head = kv_head * group + rows % group
    row_valid = (rows < block_q * group) & (token < seq_q_end)
    position = first_position + token - seq_q_start
    dims = tl.arange(0, BLOCK_D)
    dim_valid = dims < HEAD_DIM
    out_mask = row_valid[:, None] & dim_valid[None, :]
    out_ptrs = out_ptr + token[:, None] * stride_ot + head[:, None] * stride_oh + dims[None, :]

    last_token = tl.minimum(q_start + block_q, seq_q_end) - 1
    kv_end = first_position + last_token - seq_q_start + 1
    key_tiles = tl.cdiv(kv_end, BLOCK_N)
    q = tl.load(q_ptr + token[:, None] * stride_qt + head[:, None] * stride_qh + dims[None, :],
                mask=out_mask, other=0.0)
    # The parts are the grid's third dimension, not a compile-time constant: one compiled kernel serves split
    # and whole launches of a tile shape (a materialised graph names its kernels, and a name must mean one
    # kernel). CAN_SPLIT compiles them in only where they may be used (decode rows); the prefill tiles' kernel
    # is the plain pass. The key loop stays outside any branch (so the compiler pipelines it): a context
    # shorter than two key tiles a part is walked whole by part 0 while the other parts' ranges are empty, so
    # a graph captured with parts costs little at short lengths.
    if CAN_SPLIT:
        parts = tl.num_programs(2)
        whole = (parts == 1) | (key_tiles < 2 * parts)
        per_part = tl.where(whole, key_tiles, tl.cdiv(key_tiles, parts)) * BLOCK_N
        lo = tl.where(whole, tl.where(split == 0, 0, kv_end), split * per_part)
        hi = tl.minimum(lo + per_part, kv_end)
        m_i, l_i, acc = _attend(q, k_cache_ptr, v_cache_ptr, block_tables_ptr, seq, kv_head, position, lo, hi,
                                scale, stride_kslot, stride_kh, stride_vslot, stride_vh, stride_bt, dims, dim_valid,
                                BLOCK_M, BLOCK_N, BLOCK_D, KV_BLOCK_SIZE, PRECISION)
        if whole:
            if split == 0:
                tl.store(out_ptrs, (acc / l_i[:, None]).to(out_ptr.dtype.element_ty), mask=out_mask)
        else:
            _merge_parts(m_i, l_i, acc, out_ptrs, out_mask, partial_ml_ptr, partial_acc_ptr, arrivals_ptr,
                         tile * tl.num_programs(1) + kv_head, split, parts, rows, dims, BLOCK_M, BLOCK_D)
    else:
        m_i, l_i, acc = _attend(q, k_cache_ptr, v_cache_ptr, block_tables_ptr, seq, kv_head, position, 0, kv_end,
                                scale, stride_kslot, stride_kh, stride_vslot, stride_vh, stride_bt, dims, dim_valid,
                                BLOCK_M, BLOCK_N, BLOCK_D, KV_BLOCK_SIZE, PRECISION)
        tl.store(out_ptrs, (acc / l_i[:, None]).to(out_ptr.dtype.element_ty), mask=out_mask)


@triton.jit
def _merge_parts(m_i, l_i, acc, out_ptrs, out_mask, partial_ml_ptr, partial_acc_ptr, arrivals_ptr, program, split,
                 parts, rows, dims, BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr):
    """Store this part's max, sum and unnormalised output; the part that arrives last merges every part's
    into the output (an online softmax over the parts) and sets the count back to zero."""
    part = (program * parts + split) * BLOCK_M + rows
    tl.store(partial_ml_ptr + part * 2, m_i)
    tl.store(partial_ml_ptr + part * 2 + 1, l_i)
    tl.store(partial_acc_ptr + part[:, None] * BLOCK_D + dims[None, :], acc)
    # One thread counts for the program: the barrier puts every thread's stores before its count, whose
    # release publishes them; the last part acquires everyone's (and reads past its L1: .cg)
    tl.debug_barrier()
    arrived = tl.atomic_add(arrivals_ptr + program, 1, sem="acq_rel")
    if arrived == parts - 1:
        m = tl.full([BLOCK_M], -1e30, dtype=tl.float32)
        l_sum = tl.zeros([BLOCK_M], dtype=tl.float32)
        out = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
        for other in range(parts):
            at = (program * parts + other) * BLOCK_M + rows
            m_other = tl.load(partial_ml_ptr + at * 2, cache_modifier=".cg")
            l_other = tl.load(partial_ml_ptr + at * 2 + 1, cache_modifier=".cg")
            acc_other = tl.load(partial_acc_ptr + at[:, None] * BLOCK_D + dims[None, :], cache_modifier=".cg")
            m_new = tl.maximum(m, m_other)
            keep, take = tl.exp(m - m_new), tl.exp(m_other - m_new)
            l_sum = l_sum * keep + l_other * take
            out = out * keep[:, None] + acc_other * take[:, None]
            m = m_new
        tl.store(out_ptrs, (out / l_sum[:, None]).to(out_ptrs.dtype.element_ty), mask=out_mask)
        tl.atomic_xchg(arrivals_ptr + program, 0)


@triton.jit
def _attend(q, k_cache_ptr, v_cache_ptr, block_tables_ptr, seq, kv_head, position, lo, hi,
            scale, stride_kslot, stride_kh, stride_vslot, stride_vh, stride_bt, dims, dim_valid,
            BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, KV_BLOCK_SIZE: tl.constexpr,
            PRECISION: tl.constexpr):
    """Online softmax of the tile's rows over keys [lo, hi): the running max, the sum and the unnormalised
    output."""
    m_i = tl.full([BLOCK_M], -1e30, dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    for start in range(lo, hi, BLOCK_N):
        keys = start + tl.arange(0, BLOCK_N)
        key_valid = keys < hi
        block = tl.load(block_tables_ptr + seq * stride_bt + keys // KV_BLOCK_SIZE, mask=key_valid, other=0)
        slot = block.to(tl.int64) * KV_BLOCK_SIZE + keys % KV_BLOCK_SIZE
        kv_mask = key_valid[:, None] & dim_valid[None, :]
        k = tl.load(k_cache_ptr + slot[:, None] * stride_kslot + kv_head * stride_kh + dims[None, :],
                    mask=kv_mask, other=0.0)
        scores = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale
        visible = (keys[None, :] <= position[:, None]) & key_valid[None, :]
        scores = tl.where(visible, scores, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(scores, 1))
        alpha = tl.exp(m_i - m_new)
        p = tl.exp(scores - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(v_cache_ptr + slot[:, None] * stride_vslot + kv_head * stride_vh + dims[None, :],
                    mask=kv_mask, other=0.0)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        m_i = m_new
    return m_i, l_i, acc


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata,
                    scale: float, out: torch.Tensor | None = None) -> torch.Tensor:
    """q: [T, heads, head_dim]; caches: [num_blocks, block_size, kv_heads, head_dim]. With `meta.split` and
    few enough programs, each tile's keys are split in `meta.split.splits` parts run side by side."""
    num_heads, head_dim = q.shape[1], q.shape[2]
    num_kv_heads, block_size = k_cache.shape[2], k_cache.shape[1]
    group = num_heads // num_kv_heads
    out = torch.empty_like(q) if out is None else out
    k_flat = k_cache.view(-1, num_kv_heads, head_dim)
    v_flat = v_cache.view(-1, num_kv_heads, head_dim)
    block_m = max(16, triton.next_power_of_2(meta.block_q * group))
    block_d = max(16, triton.next_power_of_2(head_dim))
    programs = meta.tile_seq.shape[0] * num_kv_heads
    split = meta.split
    can_split = split is not None and split.fits(block_m, block_d)
    splits = split.splits if can_split and programs <= split.max_programs else 1
    # the same argument types whether split or not (Triton compiles a kernel per pointer type)
    scratch = (split.partial_ml, split.partial_acc, split.arrivals) if split is not None else _no_scratch(q.device)
    _paged_attention_kernel[(meta.tile_seq.shape[0], num_kv_heads, splits)](
        q, k_flat, v_flat, out,
        meta.tile_seq, meta.tile_q_start, meta.query_start_loc, meta.seq_lens, meta.block_tables,
        *scratch,
        scale,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1), k_flat.stride(0), k_flat.stride(1),
        v_flat.stride(0), v_flat.stride(1), meta.block_tables.stride(0),
        group, meta.block_q, BLOCK_M=block_m, BLOCK_N=BLOCK_N,
        HEAD_DIM=head_dim, BLOCK_D=block_d, KV_BLOCK_SIZE=block_size,
        PRECISION="ieee" if q.dtype == torch.float32 else "tf32", CAN_SPLIT=can_split,
        num_warps=4 if block_m <= 32 else 8, **launch_options(q.device),
    )
    return out


def _no_scratch(device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Stand-ins for a call without split scratch (never read: it runs whole)."""
    return (torch.empty(2, dtype=torch.float32, device=device), torch.empty(2, dtype=torch.float32, device=device),
            torch.zeros(1, dtype=torch.int32, device=device))
