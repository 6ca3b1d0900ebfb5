"""Triton rotary embedding fused with the KV write: one program per token rotates its q and k heads in place
and writes its keys (rotated) and values into their slot of the block-paged cache.

One launch instead of two in every decoder layer: inside a decode CUDA graph each launch costs its run time
and a gap before the next kernel starts. The KV write is a Triton kernel rather than torch's index_copy_,
which takes two launches (keys, values) of a kernel from a compressed libtorch_cuda module that the driver
loads on first use (13-17 ms of a fresh process's graph restore on the H100).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from runtime.engine.kernels.dependent_launch import launch_options, wait_for_previous
from runtime.engine.kernels.shape_class import half_block, heads_block


@triton.jit
def _rotated_halves(x1, x2, cos, sin):
    """Heads' first and second halves ([heads, half]) rotated (rotate-half convention), in their dtype: each half
    in float32, then rounded."""
    f1, f2 = x1.to(tl.float32), x2.to(tl.float32)
    return (f1 * cos[None, :] - f2 * sin[None, :]).to(x1.dtype), (f2 * cos[None, :] + f1 * sin[None, :]).to(x1.dtype)


# the head counts and the half dimension are runtime arguments (unspecialised) and the blocks their shape
# class: one compiled kernel for every model of the class (runtime/engine/kernels/shape_class.py)
@triton.jit(do_not_specialize=["num_q", "num_k", "half", "early"])
def _rotary_store_kv_kernel(q_ptr, k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, positions_ptr, slots_ptr, cos_sin_ptr,
                            stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, num_q, num_k, half,
                            BLOCK_H: tl.constexpr, BLOCK_HALF: tl.constexpr, early, PDL: tl.constexpr):
    wait_for_previous(early, PDL)
    t = tl.program_id(0)
    d = tl.arange(0, BLOCK_HALF)
    h = tl.arange(0, BLOCK_H)
    d_mask = d < half
    q_mask = (h < num_q)[:, None] & d_mask[None, :]
    kv_mask = (h < num_k)[:, None] & d_mask[None, :]
    q = q_ptr + t * stride_qt + h[:, None] * stride_qh + d[None, :]
    k = k_ptr + t * stride_kt + h[:, None] * stride_kh + d[None, :]
    v = v_ptr + t * stride_vt + h[:, None] * stride_vh + d[None, :]
    # every load before the first store: the compiler keeps loads and stores through possibly aliased pointers
    # in program order, so loads after a store would each wait for the round trip of the one before
    position = tl.load(positions_ptr + t)
    slot = tl.load(slots_ptr + t).to(tl.int64)
    q1, q2 = tl.load(q, mask=q_mask, other=0.0), tl.load(q + half, mask=q_mask, other=0.0)
    k1, k2 = tl.load(k, mask=kv_mask, other=0.0), tl.load(k + half, mask=kv_mask, other=0.0)
    v1, v2 = tl.load(v, mask=kv_mask, other=0.0), tl.load(v + half, mask=kv_mask, other=0.0)
    cos = tl.load(cos_sin_ptr + position * 2 * half + d, mask=d_mask, other=0.0)
    sin = tl.load(cos_sin_ptr + position * 2 * half + half + d, mask=d_mask, other=0.0)

    q1, q2 = _rotated_halves(q1, q2, cos, sin)
    k1, k2 = _rotated_halves(k1, k2, cos, sin)
    tl.store(q, q1, mask=q_mask)
    tl.store(q + half, q2, mask=q_mask)
    tl.store(k, k1, mask=kv_mask)
    tl.store(k + half, k2, mask=kv_mask)
    # the cache's slot: [kv_heads, head_dim], contiguous
    cached = slot * num_k * 2 * half + h[:, None] * 2 * half + d[None, :]
    tl.store(k_cache_ptr + cached, k1.to(k_cache_ptr.dtype.element_ty), mask=kv_mask)
    tl.store(k_cache_ptr + cached + half, k2.to(k_cache_ptr.dtype.element_ty), mask=kv_mask)
    tl.store(v_cache_ptr + cached, v1.to(v_cache_ptr.dtype.element_ty), mask=kv_mask)
    tl.store(v_cache_ptr + cached + half, v2.to(v_cache_ptr.dtype.element_ty), mask=kv_mask)


def rotary_store_kv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor,
                    cos_sin: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    slot_mapping: torch.Tensor) -> None:
    """q: [T, heads, head_dim], k, v: [T, kv_heads, head_dim] (any strides but a contiguous last dim: views of
    the fused qkv projection are); cos_sin: [max_pos, head_dim]; caches: [num_blocks, block_size, kv_heads,
    head_dim], contiguous. q and k are rotated in place."""
    for x in (q, k, v):
        if x.stride(-1) != 1:
            raise ValueError(f"rotary_store_kv needs each head's dimensions contiguous, got strides {x.stride()}")
    half = q.shape[-1] // 2
    _rotary_store_kv_kernel[(q.shape[0],)](
        q, k, v, k_cache, v_cache, positions, slot_mapping, cos_sin, q.stride(0), q.stride(1), k.stride(0),
        k.stride(1), v.stride(0), v.stride(1), q.shape[1], k.shape[1], half,
        BLOCK_H=heads_block(max(q.shape[1], k.shape[1])), BLOCK_HALF=half_block(half), num_warps=4,
        **launch_options(q.device))
