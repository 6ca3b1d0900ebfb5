"""Triton greedy sampling with the chosen token's log-probability: each row's first largest logit and
log_softmax at it, in one kernel.

Greedy sampling that also returns log-probabilities went through five of torch's kernels (a float copy,
log_softmax, argmax, gather, max), each from a large compressed module of libtorch_cuda that the driver loads
on its first launch: 10-33 ms apiece in a fresh process on the H200 (scripts/probe_first_launch.py), paid by the
first request after a process restore. This kernel comes from the baked Triton cache
(runtime/engine/kernels/embedding.py says the same of the embedding)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK = 2048


@triton.jit
def _greedy_logprob_kernel(logits_ptr, stride, vocab, token_ptr, logprob_ptr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    base = logits_ptr + row * stride
    # each lane keeps the first index of its largest value (a later equal value does not replace it)
    best = tl.full([BLOCK], float("-inf"), tl.float32)
    best_at = tl.zeros([BLOCK], tl.int32)
    for start in range(0, vocab, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        x = tl.load(base + cols, mask=cols < vocab, other=float("-inf")).to(tl.float32)
        larger = x > best
        best = tl.where(larger, x, best)
        best_at = tl.where(larger, cols, best_at)
    top = tl.max(best, 0)
    token = tl.min(tl.where(best == top, best_at, vocab), 0)
    total = tl.zeros([BLOCK], tl.float32)
    for start in range(0, vocab, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        x = tl.load(base + cols, mask=cols < vocab, other=float("-inf")).to(tl.float32)
        total += tl.exp(x - top)
    tl.store(token_ptr + row, token.to(tl.int64))
    tl.store(logprob_ptr + row, -tl.log(tl.sum(total, 0)))  # log_softmax at the largest logit


def greedy_with_logprob(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """logits: [B, vocab], rows contiguous -> (each row's argmax, first on ties, int64 [B]; log_softmax of
    the row, in float32, at it [B])."""
    rows, vocab = logits.shape
    tokens = torch.empty(rows, dtype=torch.int64, device=logits.device)
    logprobs = torch.empty(rows, dtype=torch.float32, device=logits.device)
    if rows:
        _greedy_logprob_kernel[(rows,)](logits, logits.stride(0), vocab, tokens, logprobs, BLOCK=BLOCK,
                                        num_warps=8)
    return tokens, logprobs
