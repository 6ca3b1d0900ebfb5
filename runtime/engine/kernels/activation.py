"""Triton SwiGLU gate: out = silu(x[:, :I]) * x[:, I:] for the fused gate_up projection.

`swiglu` is the gate's arithmetic alone, shared with the few-token down projection that computes the gate on
the fly (runtime/engine/kernels/gemv.py), so that both give the same bits."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from runtime.engine.kernels.dependent_launch import launch_options, wait_for_previous

BLOCK = 1024


@triton.jit
def swiglu(gate, up):
    """silu(gate) * up in gate's dtype: silu rounded to the dtype, then the product in float32, rounded (the
    model-dtype ops of Hugging Face's act_fn(gate) * up)."""
    g = gate.to(tl.float32)
    activated = (g / (1.0 + tl.exp(-g))).to(gate.dtype).to(tl.float32)
    return (activated * up.to(tl.float32)).to(gate.dtype)


@triton.jit(do_not_specialize=["early"])
def _silu_and_mul_kernel(x_ptr, out_ptr, stride_x, stride_out, size, BLOCK: tl.constexpr, early, PDL: tl.constexpr):
    wait_for_previous(early, PDL)
    t, chunk = tl.program_id(0), tl.program_id(1)
    cols = chunk * BLOCK + tl.arange(0, BLOCK)
    mask = cols < size
    gate = tl.load(x_ptr + t * stride_x + cols, mask=mask, other=0.0)
    up = tl.load(x_ptr + t * stride_x + size + cols, mask=mask, other=0.0)
    tl.store(out_ptr + t * stride_out + cols, swiglu(gate, up), mask=mask)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    size = x.shape[-1] // 2
    out = torch.empty((x.shape[0], size), dtype=x.dtype, device=x.device)
    _silu_and_mul_kernel[(x.shape[0], triton.cdiv(size, BLOCK))](x, out, x.stride(0), out.stride(0), size,
                                                                 BLOCK=BLOCK, num_warps=4,
                                                                 **launch_options(x.device))
    return out
