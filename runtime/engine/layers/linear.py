"""Linear and embedding layers whose parameters are never initialised.

torch.nn's versions initialise their weights even on the meta device, and the first such call imports
torch's decomposition machinery: seconds on the start path for values that the weight load overwrites.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from runtime.engine.layers.dispatch import use_kernels


class Linear(nn.Module):
    def __init__(self, in_features: int, out_features: int, bias: bool = False) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out_features, in_features), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(out_features), requires_grad=False) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
           out: torch.Tensor | None = None) -> torch.Tensor:
    """x @ weight.T (+ bias), into `out` if given. One to eight tokens on cuda go through the few-token kernels
    (runtime/engine/kernels/gemv.py): one token's reads the weights closer to HBM bandwidth than cuBLAS does,
    and neither needs cuBLAS, whose first call in a process is slow."""
    if use_kernels(x):
        from runtime.engine.kernels.gemv import fits, gemv

        if fits(x, weight, bias, out):
            return gemv(x, weight, bias, out)
    if out is None:
        return F.linear(x, weight, bias)
    result = torch.matmul(x, weight.t(), out=out)
    return result if bias is None else result.add_(bias)


class Embedding(nn.Module):
    def __init__(self, num_embeddings: int, dim: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_embeddings, dim), requires_grad=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if use_kernels(ids):
            from runtime.engine.kernels.embedding import embedding

            return embedding(ids, self.weight)
        return F.embedding(ids, self.weight)
