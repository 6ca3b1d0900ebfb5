"""Linear and embedding layers whose parameters are never initialised.

torch.nn's versions initialise their weights even on the meta device, and the first such call imports
torch's decomposition machinery: seconds on the start path for values that the weight load overwrites.
On the CPU a projection whose weight is exactly 4- or 8-bit groups also keeps it packed, and steps of a few
tokens read that instead (runtime/engine/cpu/packed.py).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from runtime.engine.cpu.packed import MAX_TOKENS, PackedWeight, packed_kernels
from runtime.engine.layers.activation import silu_and_mul
from runtime.engine.layers.dispatch import use_kernels


class Linear(nn.Module):
    def __init__(self, in_features: int, out_features: int, bias: bool = False) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out_features, in_features), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(out_features), requires_grad=False) if bias else None
        self.packed: PackedWeight | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed is not None and x.shape[0] <= MAX_TOKENS:
            return packed_kernels().gemv(x, self.packed, self.bias)
        return linear(x, self.weight, self.bias)

    def gated(self, gate_up: torch.Tensor) -> torch.Tensor:
        """self(silu_and_mul(gate_up)), the down projection of a SwiGLU MLP. One token on cuda computes the
        gate inside the product (runtime/engine/kernels/gemv.py): one launch fewer per layer."""
        if use_kernels(gate_up):
            from runtime.engine.kernels.gemv import fits, gemv

            if fits(gate_up, self.weight, self.bias, None, gated=True):
                return gemv(gate_up, self.weight, self.bias, gated=True)
        return self(silu_and_mul(gate_up))


def pack_linears(model: nn.Module) -> dict[str, int]:
    """Pack the weight of every Linear of `model` (on the CPU, float32) that is exactly 4- or 8-bit groups; a
    weight shared by two layers (tied embeddings) is packed once. Returns the packed layers and bytes."""
    kernels = packed_kernels()
    done: dict[int, PackedWeight | None] = {}
    for module in model.modules():
        if isinstance(module, Linear) and kernels is not None:
            key = module.weight.data_ptr()
            if key not in done:
                done[key] = kernels.pack(module.weight.detach())
            module.packed = done[key]
    packed = [w for w in done.values() if w is not None]
    return {"packed_layers": len(packed), "packed_bytes": sum(w.nbytes for w in packed),
            "float_layers": len(done) - len(packed)}


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
