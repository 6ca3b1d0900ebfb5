"""Triton products for a few tokens: y = x @ W.T (+ b), the projections of decode steps at batch sizes 1 to 8.

At one token a projection is one pass over its weight matrix, so it is bound by HBM bandwidth; on the H100
this kernel reads the Llama-3-8B projections faster than cuBLAS does at batch 1 (scripts/bench_gemv.py).
Each program reduces BLOCK_N rows of W over K in BLOCK_K-wide chunks, accumulating in float32.

Two to eight tokens go through a second kernel, `_few_rows_kernel`: each program takes BLOCK_N rows of W
and the tokens padded to 16 rows, on the tensor cores; still one pass over W. It is as fast as cuBLAS at
2, 4 and 8 tokens (scripts/bench_gemv.py), and it keeps cuBLAS out of the decode graphs a materialised start
builds before ready: cuBLAS's first call in a process costs tens of milliseconds, and its kernels one module
load each (docs/snapshots.md).

At one token the down projection of a SwiGLU MLP has a gated twin, `_gated_gemv_kernel`: its input is the
gate_up projection's output, and the gate silu(gate) * up is computed while the input is read, with the bits
of the gate's own kernel (runtime/engine/kernels/activation.py). A batch-1 decode step then launches one
kernel fewer per layer; inside a CUDA graph each launch costs its run time and a gap before the next starts.
Two to eight tokens keep the gate's own kernel: a gated twin of `_few_rows_kernel`, which computes the gate
for 16 padded rows in every program, made batch-8 decode steps 2.3-3 times slower on the H100.

One configuration per kernel serves every shape, and the bias and the number of tokens are runtime
arguments, so a model's products are three compiled specialisations, one per kernel: a materialised CUDA
graph finds its kernels by name (snapshots/cudagraph), and two specialisations of one Triton kernel would
share a name. `fits` keeps it that way, sending anything else (an unaligned view, a dimension not a
multiple of 16, more than eight tokens) to cuBLAS.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from runtime.engine.kernels.activation import swiglu
from runtime.engine.kernels.dependent_launch import launch_options, wait_for_previous

BLOCK_N, BLOCK_K = 8, 1024
ALIGN = 16  # bytes; Triton specialises pointers (and sizes) on divisibility by 16


@triton.jit
def _input_tile(x_ptr, cols, mask, K, GATED: tl.constexpr):
    """One token's input at COLS: x [K] itself, or, GATED, the SwiGLU gate of the gate_up projection's output
    x [2K], computed as the gate's own kernel computes it."""
    if GATED:
        tile = swiglu(tl.load(x_ptr + cols, mask=mask, other=0.0), tl.load(x_ptr + K + cols, mask=mask, other=0.0))
    else:
        tile = tl.load(x_ptr + cols, mask=mask, other=0.0)
    return tile


@triton.jit
def _one_row(w_ptr, x_ptr, bias_ptr, y_ptr, N, K, has_bias, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
             GATED: tl.constexpr, early, PDL: tl.constexpr):
    wait_for_previous(early, PDL)
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_valid = rows < N
    acc = tl.zeros([BLOCK_N], dtype=tl.float32)
    for start in range(0, K, BLOCK_K):
        cols = start + tl.arange(0, BLOCK_K)
        col_valid = cols < K
        w = tl.load(w_ptr + rows[:, None] * K + cols[None, :], mask=row_valid[:, None] & col_valid[None, :],
                    other=0.0)
        x = _input_tile(x_ptr, cols, col_valid, K, GATED)
        acc += tl.sum(w.to(tl.float32) * x.to(tl.float32)[None, :], axis=1)
    if has_bias != 0:
        acc += tl.load(bias_ptr + rows, mask=row_valid, other=0.0).to(tl.float32)
    tl.store(y_ptr + rows, acc.to(y_ptr.dtype.element_ty), mask=row_valid)


@triton.jit(do_not_specialize=["M", "has_bias", "early"])
def _few_rows_kernel(w_ptr, x_ptr, bias_ptr, y_ptr, M, N, K, has_bias, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                     BLOCK_K: tl.constexpr, early, PDL: tl.constexpr):
    wait_for_previous(early, PDL)
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    tokens = tl.arange(0, BLOCK_M)
    row_valid, token_valid = rows < N, tokens < M
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for start in range(0, K, BLOCK_K):
        cols = start + tl.arange(0, BLOCK_K)
        col_valid = cols < K
        w = tl.load(w_ptr + rows[None, :] * K + cols[:, None], mask=row_valid[None, :] & col_valid[:, None],
                    other=0.0)  # [BLOCK_K, BLOCK_N]: W's rows as columns
        x = tl.load(x_ptr + tokens[:, None] * K + cols[None, :], mask=token_valid[:, None] & col_valid[None, :],
                    other=0.0)
        acc = tl.dot(x, w, acc)
    if has_bias != 0:
        acc += tl.load(bias_ptr + rows, mask=row_valid, other=0.0).to(tl.float32)[None, :]
    tl.store(y_ptr + tokens[:, None] * N + rows[None, :], acc.to(y_ptr.dtype.element_ty),
             mask=token_valid[:, None] & row_valid[None, :])


# The one-token kernel and its gated twin share a body; the gated one is a kernel of its own, with its own
# name, for the reason above (snapshots/cudagraph finds a kernel by name)
@triton.jit(do_not_specialize=["has_bias", "early"])
def _gemv_kernel(w_ptr, x_ptr, bias_ptr, y_ptr, N, K, has_bias, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                 early, PDL: tl.constexpr):
    _one_row(w_ptr, x_ptr, bias_ptr, y_ptr, N, K, has_bias, BLOCK_N, BLOCK_K, False, early, PDL)


@triton.jit(do_not_specialize=["has_bias", "early"])
def _gated_gemv_kernel(w_ptr, x_ptr, bias_ptr, y_ptr, N, K, has_bias, BLOCK_N: tl.constexpr,
                       BLOCK_K: tl.constexpr, early, PDL: tl.constexpr):
    _one_row(w_ptr, x_ptr, bias_ptr, y_ptr, N, K, has_bias, BLOCK_N, BLOCK_K, True, early, PDL)


MAX_FEW_ROWS = 8
FEW_BLOCK_M, FEW_BLOCK_N, FEW_BLOCK_K = 16, 16, 512  # 16: the tensor cores' smallest tile


def fits(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, out: torch.Tensor | None,
         gated: bool = False) -> bool:
    """Whether this product is one to eight tokens' and lands in the single specialisation its kernel is used
    at. Two to eight tokens take 16-bit weights only: on float32 the tensor cores would round to TF32.
    `gated`: x is one token of a gate_up projection's output, twice the weight's input wide (see `gemv`)."""
    if x.dim() != 2 or not 1 <= x.shape[0] <= MAX_FEW_ROWS or not x.is_contiguous() or not weight.is_contiguous():
        return False
    if gated and x.shape[0] != 1:
        return False
    if x.shape[0] > 1 and weight.dtype not in (torch.bfloat16, torch.float16):
        return False
    n, k = weight.shape
    tensors = [x, weight] + [t for t in (bias, out) if t is not None]
    return (n % ALIGN == 0 and k % ALIGN == 0 and weight.dtype == x.dtype and x.shape[1] == (2 * k if gated else k)
            and (out is None or (out.dtype == x.dtype and out.is_contiguous()))
            and all(t.data_ptr() % ALIGN == 0 for t in tensors))


def gemv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
         out: torch.Tensor | None = None, gated: bool = False) -> torch.Tensor:
    """x: [M, K] (M 1 to 8); weight: [N, K]; bias: [N] or None. Returns [M, N] in x's dtype (into `out` if
    given). `gated` (M 1): x is [1, 2K], a gate_up projection's output, and the product's input is its SwiGLU gate
    silu(x[:, :K]) * x[:, K:], computed on the fly with the bits of runtime/engine/kernels/activation.py's
    kernel: one launch instead of two, and the gate never goes through memory."""
    m = x.shape[0]
    n, k = weight.shape
    out = torch.empty((m, n), dtype=x.dtype, device=x.device) if out is None else out
    if m > 1:
        assert not gated, "the gate is folded into one token's product only (fits)"
        _few_rows_kernel[(triton.cdiv(n, FEW_BLOCK_N),)](weight, x, weight if bias is None else bias, out, m, n, k,
                                                       0 if bias is None else 1, BLOCK_M=FEW_BLOCK_M,
                                                       BLOCK_N=FEW_BLOCK_N, BLOCK_K=FEW_BLOCK_K, num_warps=4,
                                                       num_stages=3, **launch_options(x.device))
        return out
    # without a bias the weight stands in for its pointer: never read, and aligned like the real one
    one_row = _gated_gemv_kernel if gated else _gemv_kernel
    one_row[(triton.cdiv(n, BLOCK_N),)](weight, x, weight if bias is None else bias, out, n, k,
                                        0 if bias is None else 1, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K, num_warps=8,
                                        num_stages=3, **launch_options(x.device))
    return out
