"""Triton RMSNorm over the last dimension, optionally fused with the residual add before it.

With a residual it works in place (x <- norm(x + residual), residual <- x + residual), as the decoder
layers chain it; without one it writes a new tensor, since callers keep using their input.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rms_norm_kernel(x_ptr, residual_ptr, weight_ptr, out_ptr, stride_x0, stride_x1, stride_r0, stride_r1,
                     stride_o0, stride_o1, size, eps, HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr):
    # Rows are addressed by two indices so a [tokens, heads, head_dim] view (q/k norm) needs no copy.
    i, j = tl.program_id(0), tl.program_id(1)
    cols = tl.arange(0, BLOCK)
    mask = cols < size
    x = tl.load(x_ptr + i * stride_x0 + j * stride_x1 + cols, mask=mask, other=0.0).to(tl.float32)
    dtype = x_ptr.dtype.element_ty
    if HAS_RESIDUAL:
        r_row = residual_ptr + i * stride_r0 + j * stride_r1
        x = (x + tl.load(r_row + cols, mask=mask, other=0.0).to(tl.float32)).to(dtype).to(tl.float32)
        tl.store(r_row + cols, x.to(dtype), mask=mask)
    variance = tl.sum(x * x, axis=0) / size
    normed = (x * tl.rsqrt(variance + eps)).to(dtype).to(tl.float32)
    w = tl.load(weight_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + i * stride_o0 + j * stride_o1 + cols, (normed * w).to(dtype), mask=mask)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None):
    size = x.shape[-1]
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device) if residual is None else x
    x3, o3 = (x, out) if x.dim() == 3 else (x.unsqueeze(1), out.unsqueeze(1))
    r3 = x3 if residual is None else (residual if residual.dim() == 3 else residual.unsqueeze(1))
    _rms_norm_kernel[(x3.shape[0], x3.shape[1])](
        x3, r3, weight, o3, x3.stride(0), x3.stride(1), r3.stride(0), r3.stride(1), o3.stride(0), o3.stride(1),
        size, eps, HAS_RESIDUAL=residual is not None, BLOCK=triton.next_power_of_2(size),
        num_warps=4 if size <= 2048 else 8)
    return out if residual is None else (out, residual)
