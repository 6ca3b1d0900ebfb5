"""The SwiGLU gate: silu(gate) * up over the fused gate_up projection's output."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from runtime.engine.layers.dispatch import use_kernels


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    if use_kernels(x):
        from runtime.engine.kernels.activation import silu_and_mul as kernel

        return kernel(x)
    # in place on the projection's output (the caller's scratch): one new tensor instead of two
    gate, up = x.chunk(2, dim=-1)
    return torch.mul(F.silu(gate, inplace=True), up)
