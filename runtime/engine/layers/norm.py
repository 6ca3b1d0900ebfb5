"""RMSNorm, optionally fused with the residual add that precedes it (Llama's pre-norm blocks)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from runtime.engine.layers.dispatch import use_kernels


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.empty(size), requires_grad=False)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        """Without `residual`: norm(x). With it: (norm(x + residual), x + residual), in place (x is the
        previous layer's output, scratch)."""
        if use_kernels(x):
            from runtime.engine.kernels.norm import rms_norm

            return rms_norm(x, self.weight, self.eps, residual)
        if residual is None:
            return rms_norm_reference(x, self.weight, self.eps)
        summed = x.add_(residual)
        return rms_norm_reference(summed, self.weight, self.eps), summed


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    # Same order of operations as Hugging Face's LlamaRMSNorm: statistics in float32, scale in the model dtype.
    # In float32 that is the computation of torch's fused rms_norm: one op instead of six.
    if x.dtype == torch.float32 and weight.dtype == torch.float32:
        return F.rms_norm(x, weight.shape, weight, eps)
    dtype = x.dtype
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(dtype)
