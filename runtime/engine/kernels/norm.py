"""Triton RMSNorm over the last dimension, and RMSNorm fused with the residual add before it.

The fused one works in place (x <- norm(x + residual), residual <- x + residual), as the decoder layers chain
it; the plain one writes a new tensor, since its callers keep using their input. They are two kernels with
two names, not one kernel with a switch: a materialised CUDA graph finds its kernels by name
(snapshots/cudagraph), and two specialisations of one Triton kernel would share a name.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from runtime.engine.kernels.dependent_launch import launch_options, wait_for_previous
from runtime.engine.kernels.shape_class import row_block, row_warps


@triton.jit
def _normalise_row(x, w_ptr, out_row, cols, mask, size, eps, dtype: tl.constexpr):
    variance = tl.sum(x * x, axis=0) / size
    normed = (x * tl.rsqrt(variance + eps)).to(dtype).to(tl.float32)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_row + cols, (normed * w).to(dtype), mask=mask)


@triton.jit(do_not_specialize=["early"])
def _rms_norm_kernel(x_ptr, weight_ptr, out_ptr, stride_x, stride_o, size, eps, BLOCK: tl.constexpr,
                     early, PDL: tl.constexpr):
    wait_for_previous(early, PDL)
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    mask = cols < size
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    _normalise_row(x, weight_ptr, out_ptr + row * stride_o, cols, mask, size, eps, x_ptr.dtype.element_ty)


# A kernel of its own for the q/k norm (Qwen3), not the row kernel with a second index: the two run at
# different BLOCKs in one model, and a materialised graph finds its kernels by name (snapshots/cudagraph), which
# two specialisations of one Triton function share.
@triton.jit(do_not_specialize=["early"])
def _head_rms_norm_kernel(x_ptr, weight_ptr, out_ptr, stride_x0, stride_x1, stride_o0, stride_o1, size, eps,
                          BLOCK: tl.constexpr, early, PDL: tl.constexpr):
    # Rows are addressed by two indices so a [tokens, heads, head_dim] view needs no copy.
    wait_for_previous(early, PDL)
    i, j = tl.program_id(0), tl.program_id(1)
    cols = tl.arange(0, BLOCK)
    mask = cols < size
    x = tl.load(x_ptr + i * stride_x0 + j * stride_x1 + cols, mask=mask, other=0.0).to(tl.float32)
    _normalise_row(x, weight_ptr, out_ptr + i * stride_o0 + j * stride_o1, cols, mask, size, eps,
                   x_ptr.dtype.element_ty)


@triton.jit(do_not_specialize=["early"])
def _add_rms_norm_kernel(x_ptr, residual_ptr, weight_ptr, stride_x, stride_r, size, eps, BLOCK: tl.constexpr,
                         early, PDL: tl.constexpr):
    wait_for_previous(early, PDL)
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    mask = cols < size
    dtype = x_ptr.dtype.element_ty
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    r = tl.load(residual_ptr + row * stride_r + cols, mask=mask, other=0.0).to(tl.float32)
    summed = (x + r).to(dtype)  # the add happens in the model dtype, as in Hugging Face's layers
    tl.store(residual_ptr + row * stride_r + cols, summed, mask=mask)
    _normalise_row(summed.to(tl.float32), weight_ptr, x_ptr + row * stride_x, cols, mask, size, eps, dtype)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None):
    size = x.shape[-1]
    # a row of the hidden size at its shape class's block; the q/k norm's row, a head, at its own size
    block = row_block(size) if x.dim() == 2 else triton.next_power_of_2(size)
    warps = row_warps(block)
    launch = launch_options(x.device)
    if residual is not None:
        _add_rms_norm_kernel[(x.shape[0],)](x, residual, weight, x.stride(0), residual.stride(0), size, eps,
                                            BLOCK=block, num_warps=warps, **launch)
        return x, residual
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    if x.dim() == 3:
        _head_rms_norm_kernel[(x.shape[0], x.shape[1])](x, weight, out, x.stride(0), x.stride(1), out.stride(0),
                                                        out.stride(1), size, eps, BLOCK=block, num_warps=warps,
                                                        **launch)
    else:
        _rms_norm_kernel[(x.shape[0],)](x, weight, out, x.stride(0), out.stride(0), size, eps, BLOCK=block,
                                        num_warps=warps, **launch)
    return out
