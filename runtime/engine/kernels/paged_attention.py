"""Triton paged attention for prefill, decode and mixed batches (one kernel for all three).

Each program handles one tile — up to BLOCK_Q query tokens of one sequence — for one KV head, with all the
query heads that share that KV head (grouped-query attention) stacked as rows, so a KV tile is loaded once
per group. Keys and values are gathered from the paged cache through the sequence's block table, in tiles
of BLOCK_N positions, with an online softmax; causality is per row (each query token sees the positions up
to its own). The plain PyTorch reference in runtime/engine/layers/attention.py is what this is tested against.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from runtime.engine.attention_metadata import AttentionMetadata

BLOCK_N = 64


# The group (query heads per KV head) and the tile's query tokens are runtime arguments, unspecialised: the
# compiled kernel is one per shape class (BLOCK_M rows, the head dimension), shared by every model of that
# class (runtime/engine/kernels/shape_class.py)
@triton.jit(do_not_specialize=["group", "block_q"])
def _paged_attention_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, out_ptr,
    tile_seq_ptr, tile_q_start_ptr, query_start_ptr, seq_lens_ptr, block_tables_ptr,
    scale,
    stride_qt, stride_qh, stride_ot, stride_oh, stride_kslot, stride_kh, stride_vslot, stride_vh, stride_bt,
    group, block_q, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, KV_BLOCK_SIZE: tl.constexpr, PRECISION: tl.constexpr,
):
    tile = tl.program_id(0)
    kv_head = tl.program_id(1)
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

    q = tl.load(q_ptr + token[:, None] * stride_qt + head[:, None] * stride_qh + dims[None, :],
                mask=row_valid[:, None] & dim_valid[None, :], other=0.0)
    m_i = tl.full([BLOCK_M], -1e30, dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)

    last_token = tl.minimum(q_start + block_q, seq_q_end) - 1
    kv_end = first_position + last_token - seq_q_start + 1
    for start in range(0, kv_end, BLOCK_N):
        keys = start + tl.arange(0, BLOCK_N)
        key_valid = keys < kv_end
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

    out = acc / l_i[:, None]
    tl.store(out_ptr + token[:, None] * stride_ot + head[:, None] * stride_oh + dims[None, :],
             out.to(out_ptr.dtype.element_ty), mask=row_valid[:, None] & dim_valid[None, :])


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata,
                    scale: float, out: torch.Tensor | None = None) -> torch.Tensor:
    """q: [T, heads, head_dim]; caches: [num_blocks, block_size, kv_heads, head_dim]."""
    num_heads, head_dim = q.shape[1], q.shape[2]
    num_kv_heads, block_size = k_cache.shape[2], k_cache.shape[1]
    group = num_heads // num_kv_heads
    out = torch.empty_like(q) if out is None else out
    k_flat = k_cache.view(-1, num_kv_heads, head_dim)
    v_flat = v_cache.view(-1, num_kv_heads, head_dim)
    block_m = max(16, triton.next_power_of_2(meta.block_q * group))
    grid = (meta.tile_seq.shape[0], num_kv_heads)
    _paged_attention_kernel[grid](
        q, k_flat, v_flat, out,
        meta.tile_seq, meta.tile_q_start, meta.query_start_loc, meta.seq_lens, meta.block_tables,
        scale,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1), k_flat.stride(0), k_flat.stride(1),
        v_flat.stride(0), v_flat.stride(1), meta.block_tables.stride(0),
        group, meta.block_q, BLOCK_M=block_m, BLOCK_N=BLOCK_N,
        HEAD_DIM=head_dim, BLOCK_D=max(16, triton.next_power_of_2(head_dim)), KV_BLOCK_SIZE=block_size,
        PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        num_warps=4 if block_m <= 32 else 8,
    )
    return out
