"""Triton matrix-vector product for a single token: y = x @ W.T (+ b), the projections of a batch-1 decode step.

At one token a projection is one pass over its weight matrix, so it is bound by HBM bandwidth. On the H100
cuBLAS read the Llama-3-8B projections at 2.0-2.9 TB/s at batch 1; this kernel read them at 2.6-3.2 TB/s
(docs/benchmarks.md, "Decode throughput", seventh session). Each program reduces BLOCK_N rows of W over K in
BLOCK_K-wide chunks, accumulating in float32.

One configuration serves every shape and the bias is a runtime flag, so a model's GEMVs are all one compiled
specialisation: a materialised CUDA graph finds its kernels by name (snapshots/cudagraph), and two
specialisations of one Triton kernel would share this one's name. `fits` keeps it that way, sending anything
else (an unaligned view, a dimension not a multiple of 16) to cuBLAS.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK_N, BLOCK_K = 8, 1024
ALIGN = 16  # bytes; Triton specialises pointers (and sizes) on divisibility by 16


@triton.jit(do_not_specialize=["has_bias"])
def _gemv_kernel(w_ptr, x_ptr, bias_ptr, y_ptr, N, K, has_bias, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_valid = rows < N
    acc = tl.zeros([BLOCK_N], dtype=tl.float32)
    for start in range(0, K, BLOCK_K):
        cols = start + tl.arange(0, BLOCK_K)
        col_valid = cols < K
        w = tl.load(w_ptr + rows[:, None] * K + cols[None, :], mask=row_valid[:, None] & col_valid[None, :],
                    other=0.0)
        x = tl.load(x_ptr + cols, mask=col_valid, other=0.0)
        acc += tl.sum(w.to(tl.float32) * x.to(tl.float32)[None, :], axis=1)
    if has_bias != 0:
        acc += tl.load(bias_ptr + rows, mask=row_valid, other=0.0).to(tl.float32)
    tl.store(y_ptr + rows, acc.to(y_ptr.dtype.element_ty), mask=row_valid)


def fits(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, out: torch.Tensor | None) -> bool:
    """Whether this product is one token's and lands in the single specialisation the kernel is used at."""
    if x.dim() != 2 or x.shape[0] != 1 or not x.is_contiguous() or not weight.is_contiguous():
        return False
    n, k = weight.shape
    tensors = [x, weight] + [t for t in (bias, out) if t is not None]
    return (n % ALIGN == 0 and k % ALIGN == 0 and weight.dtype == x.dtype
            and (out is None or (out.dtype == x.dtype and out.is_contiguous()))
            and all(t.data_ptr() % ALIGN == 0 for t in tensors))


def gemv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
         out: torch.Tensor | None = None) -> torch.Tensor:
    """x: [1, K]; weight: [N, K]; bias: [N] or None. Returns [1, N] in x's dtype (into `out` if given)."""
    n, k = weight.shape
    out = torch.empty((1, n), dtype=x.dtype, device=x.device) if out is None else out
    # without a bias the weight stands in for its pointer: never read, and aligned like the real one
    _gemv_kernel[(triton.cdiv(n, BLOCK_N),)](weight, x, weight if bias is None else bias, out, n, k,
                                             0 if bias is None else 1, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K,
                                             num_warps=8, num_stages=3)
    return out
