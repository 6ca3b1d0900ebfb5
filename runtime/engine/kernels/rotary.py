"""Triton rotary embedding, applied in place to the q and k heads of one token per program."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from runtime.engine.kernels.shape_class import half_block, heads_block


# the head counts and the half dimension are runtime arguments (unspecialised) and the blocks their shape
# class: one compiled kernel for every model of the class (runtime/engine/kernels/shape_class.py)
@triton.jit(do_not_specialize=["num_q", "num_k", "half"])
def _rotary_kernel(q_ptr, k_ptr, positions_ptr, cos_sin_ptr, stride_qt, stride_qh, stride_kt, stride_kh,
                   num_q, num_k, half, BLOCK_H: tl.constexpr, BLOCK_HALF: tl.constexpr):
    t = tl.program_id(0)
    position = tl.load(positions_ptr + t)
    d = tl.arange(0, BLOCK_HALF)
    d_mask = d < half
    cos = tl.load(cos_sin_ptr + position * 2 * half + d, mask=d_mask, other=0.0)
    sin = tl.load(cos_sin_ptr + position * 2 * half + half + d, mask=d_mask, other=0.0)
    h = tl.arange(0, BLOCK_H)
    for which in tl.static_range(2):
        if which == 0:
            base, stride_h, count = q_ptr + t * stride_qt, stride_qh, num_q
        else:
            base, stride_h, count = k_ptr + t * stride_kt, stride_kh, num_k
        mask = (h < count)[:, None] & d_mask[None, :]
        ptrs = base + h[:, None] * stride_h + d[None, :]
        x1 = tl.load(ptrs, mask=mask, other=0.0)
        x2 = tl.load(ptrs + half, mask=mask, other=0.0)
        f1, f2 = x1.to(tl.float32), x2.to(tl.float32)
        tl.store(ptrs, (f1 * cos[None, :] - f2 * sin[None, :]).to(x1.dtype), mask=mask)
        tl.store(ptrs + half, (f2 * cos[None, :] + f1 * sin[None, :]).to(x1.dtype), mask=mask)


def rotary_inplace(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor) -> None:
    """q: [T, heads, head_dim], k: [T, kv_heads, head_dim] (last dim contiguous); cos_sin: [max_pos, head_dim]."""
    half = q.shape[-1] // 2
    _rotary_kernel[(q.shape[0],)](
        q, k, positions, cos_sin, q.stride(0), q.stride(1), k.stride(0), k.stride(1),
        q.shape[1], k.shape[1], half, BLOCK_H=heads_block(max(q.shape[1], k.shape[1])),
        BLOCK_HALF=half_block(half), num_warps=4)
