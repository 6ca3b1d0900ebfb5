"""Triton KV write: each new token's keys and values into its slot of the block-paged cache, in one launch.

torch's index_copy_ would take two launches (keys, values) of a kernel from a compressed libtorch_cuda module
that the driver loads on first use (13-17 ms of a fresh process's graph restore on the H100)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from runtime.engine.kernels.shape_class import kv_row_block


@triton.jit
def _store_kv_kernel(k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, slots_ptr, stride_kt, stride_vt, size,
                     BLOCK: tl.constexpr):
    t = tl.program_id(0)
    slot = tl.load(slots_ptr + t).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < size
    k = tl.load(k_ptr + t * stride_kt + cols, mask=mask)
    v = tl.load(v_ptr + t * stride_vt + cols, mask=mask)
    tl.store(k_cache_ptr + slot * size + cols, k.to(k_cache_ptr.dtype.element_ty), mask=mask)
    tl.store(v_cache_ptr + slot * size + cols, v.to(v_cache_ptr.dtype.element_ty), mask=mask)


def store_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """k, v: [T, kv_heads, head_dim], each token's heads contiguous (views of the fused qkv projection are);
    caches: [num_blocks, block_size, kv_heads, head_dim], contiguous."""
    size = k.shape[1] * k.shape[2]
    for x in (k, v):
        if x.stride(2) != 1 or x.stride(1) != x.shape[2]:
            raise ValueError(f"store_kv needs each token's heads contiguous, got strides {x.stride()}")
    _store_kv_kernel[(k.shape[0],)](k, v, k_cache, v_cache, slot_mapping, k.stride(0), v.stride(0), size,
                                    BLOCK=kv_row_block(size), num_warps=4)
