"""Triton token embedding: each new token's row of the embedding table, copied to the hidden states.

torch's embedding kernel lives in a large compressed module of libtorch_cuda that the driver loads on its first
launch, tens of milliseconds of a fresh process's graph restore; this kernel comes from the baked Triton cache
in a few milliseconds (docs/snapshots.md)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from runtime.engine.kernels.dependent_launch import launch_options, wait_for_previous

BLOCK = 1024


@triton.jit(do_not_specialize=["early"])
def _embedding_kernel(ids_ptr, weight_ptr, out_ptr, dim, BLOCK: tl.constexpr, early, PDL: tl.constexpr):
    wait_for_previous(early, PDL)
    t, chunk = tl.program_id(0), tl.program_id(1)
    row = tl.load(ids_ptr + t).to(tl.int64)
    cols = chunk * BLOCK + tl.arange(0, BLOCK)
    mask = cols < dim
    tl.store(out_ptr + t * dim + cols, tl.load(weight_ptr + row * dim + cols, mask=mask), mask=mask)


def embedding(ids: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """ids: [T] (every id inside the table: the engine checks prompts), weight: [vocab, dim] -> [T, dim]."""
    dim = weight.shape[1]
    out = torch.empty((ids.shape[0], dim), dtype=weight.dtype, device=weight.device)
    _embedding_kernel[(ids.shape[0], triton.cdiv(dim, BLOCK))](ids, weight, out, dim, BLOCK=BLOCK, num_warps=4,
                                                               **launch_options(ids.device))
    return out
