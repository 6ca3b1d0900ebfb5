"""Triton SwiGLU gate: out = silu(x[:, :I]) * x[:, I:] for the fused gate_up projection."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK = 1024


@triton.jit
def _silu_and_mul_kernel(x_ptr, out_ptr, stride_x, stride_out, size, BLOCK: tl.constexpr):
    t, chunk = tl.program_id(0), tl.program_id(1)
    cols = chunk * BLOCK + tl.arange(0, BLOCK)
    mask = cols < size
    gate = tl.load(x_ptr + t * stride_x + cols, mask=mask, other=0.0)
    up = tl.load(x_ptr + t * stride_x + size + cols, mask=mask, other=0.0)
    g = gate.to(tl.float32)
    activated = (g / (1.0 + tl.exp(-g))).to(gate.dtype).to(tl.float32)
    tl.store(out_ptr + t * stride_out + cols, (activated * up.to(tl.float32)).to(gate.dtype), mask=mask)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    size = x.shape[-1] // 2
    out = torch.empty((x.shape[0], size), dtype=x.dtype, device=x.device)
    _silu_and_mul_kernel[(x.shape[0], triton.cdiv(size, BLOCK))](x, out, x.stride(0), out.stride(0), size,
                                                                 BLOCK=BLOCK, num_warps=4)
    return out
