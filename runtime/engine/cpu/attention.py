"""Paged attention on the CPU: torch's fused attention kernels over each sequence's gathered keys.

A batch in which every sequence decodes one token is attended as one: every sequence's keys gathered at
once (padded to the longest, the padding masked), two batched products. Otherwise, per sequence, the keys
and values of its blocks are read as a slice of the cache where its blocks follow one another, else gathered
(one copy of its KV, [L, kv_heads, head_dim]); a whole prompt's are read where the step computed them. Its
queries, the last `num_q` of its `seq_len` positions, attend to them without masks:
- a whole prompt (no cached context) is plain causal attention (`is_causal`, the flash kernel: given as one
  batch of 4-D tensors, since with 3-D ones torch takes its math path on the CPU, 4-7 times slower from 512
  to 3,000 tokens on 2 cores);
- one query (decode) sees every key, so it needs no mask at all: the flash kernel again, 4-D;
- a slice of a prompt after cached context sees all of the context and its own keys causally: the two parts
  are attended separately and merged by their log-sum-exps, as flash attention merges its key blocks.
Grouped-query heads are not repeated, except for the log-sum-exp kernel below: the kernels read each key head
for its group of query heads.
The plain reference (runtime/engine/layers/attention.py, a boolean mask per sequence) is what this is tested
against; the mask cost more than the attention itself on long prompts.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from runtime.engine.attention_metadata import AttentionMetadata


def paged_attention_cpu(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                        meta: AttentionMetadata, scale: float,
                        new_kv: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """q: [T, heads, head_dim] -> [T, heads, head_dim]. `new_kv`: this step's keys and values [T, kv_heads,
    head_dim] (already in the cache), which a sequence without cached context attends to where they are
    instead of gathering them back."""
    starts = meta.query_start_loc_cpu or meta.query_start_loc.tolist()
    lens = meta.seq_lens_cpu or meta.seq_lens.tolist()
    block_size = k_cache.shape[1]
    if len(lens) > 1 and len(starts) - 1 == starts[-1]:  # every sequence decodes one token
        return _decode_batch(q, k_cache, v_cache, _decode_plan(meta, lens, block_size), scale)
    outs = []
    for i, seq_len in enumerate(lens):
        start, end = starts[i], starts[i + 1]
        if new_kv is not None and end - start == seq_len:
            keys, values = (t[start:end].transpose(0, 1).to(q.dtype) for t in new_kv)       # [KVH, L, D]
        else:
            first = _first_blocks(meta, lens, block_size)[i]
            blocks = (slice(first, first + -(-seq_len // block_size)) if first is not None
                      else meta.block_tables[i, : -(-seq_len // block_size)])
            keys = k_cache[blocks].flatten(0, 1)[:seq_len].transpose(0, 1).to(q.dtype)
            values = v_cache[blocks].flatten(0, 1)[:seq_len].transpose(0, 1).to(q.dtype)
        outs.append(_attend(q[start:end].transpose(0, 1), keys, values, scale).transpose(0, 1))  # [Lq, H, D]
    # one sequence (a lone prompt): its output as the kernel left it, [Lq, H, D] contiguous, without a copy
    return outs[0] if len(outs) == 1 else torch.cat(outs)


def _first_blocks(meta: AttentionMetadata, lens: list[int], block_size: int) -> list[int | None]:
    """Per sequence, its first block where all of its blocks follow one another in the cache (blocks never
    used before are handed out in order): its keys are then read as a slice of the cache, a view, instead of
    gathered, a copy of all of them for every layer (at 3,000 tokens, most of a decode step's attention).
    Made by the first layer, reused by the others."""
    if meta.cpu_first_blocks is None:
        firsts = []
        for i, seq_len in enumerate(lens):
            blocks = meta.block_tables[i, : -(-seq_len // block_size)].tolist()
            firsts.append(blocks[0] if blocks == list(range(blocks[0], blocks[0] + len(blocks))) else None)
        meta.cpu_first_blocks = firsts
    return meta.cpu_first_blocks


class _DecodePlan:
    """Where a decode batch's keys are, the same for every layer of the step: each sequence's slots, padded to
    the longest, and the additive mask that hides the padding."""

    def __init__(self, meta: AttentionMetadata, lens: list[int], block_size: int) -> None:
        longest = max(lens)
        positions = torch.arange(longest)
        tables = meta.block_tables[:, : -(-longest // block_size)].long()
        slots = tables.gather(1, (positions // block_size).expand(len(lens), -1)) * block_size + positions % block_size
        lengths = torch.tensor(lens)[:, None]
        self.slots = torch.where(positions < lengths, slots, 0)                          # [B, L]
        self.mask = torch.zeros(len(lens), 1, 1, longest).masked_fill_(
            (positions >= lengths)[:, None, None, :], float("-inf"))                     # [B, 1, 1, L]


def _decode_plan(meta: AttentionMetadata, lens: list[int], block_size: int) -> _DecodePlan:
    if meta.cpu_decode_plan is None:  # made by the first layer, reused by the others
        meta.cpu_decode_plan = _DecodePlan(meta, lens, block_size)
    return meta.cpu_decode_plan


def _decode_batch(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, plan: _DecodePlan,
                  scale: float) -> torch.Tensor:
    """A batch of decode queries [B, H, D], each over its own sequence's keys, as two batched products over
    the keys gathered once for all (a Python loop over the sequences cost more than the attention itself:
    at batch 8 on the 2-core machine, about half of a decode step)."""
    batch, heads, dim = q.shape
    kv_heads = k_cache.shape[2]
    keys = k_cache.flatten(0, 1)[plan.slots].permute(0, 2, 3, 1).to(q.dtype)          # [B, KVH, D, L]
    values = v_cache.flatten(0, 1)[plan.slots].transpose(1, 2).to(q.dtype)            # [B, KVH, L, D]
    scores = torch.matmul(q.reshape(batch, kv_heads, heads // kv_heads, dim), keys).float().mul_(scale)
    probs = scores.add_(plan.mask).softmax(-1).to(values.dtype)                        # [B, KVH, G, L]
    return torch.matmul(probs, values).reshape(batch, heads, dim)


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """q: [H, Lq, D], the last Lq of the L positions of k, v: [KVH, L, D] -> [H, Lq, D]."""
    num_q, context = q.shape[1], k.shape[1] - q.shape[1]
    if num_q == 1:
        return _one_query(q, k, v, scale)
    if context == 0:
        return F.scaled_dot_product_attention(q[None], k[None], v[None], is_causal=True, scale=scale,
                                              enable_gqa=True)[0]
    before, before_lse = _with_lse(q, k[:, :context], v[:, :context], scale, causal=False)
    own, own_lse = _with_lse(q, k[:, context:], v[:, context:], scale, causal=True)
    lse = torch.logaddexp(before_lse, own_lse)
    merged = before.float() * (before_lse - lse).exp()[..., None] + own.float() * (own_lse - lse).exp()[..., None]
    return merged.to(q.dtype)


def _one_query(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """A decode query [H, 1, D] over all of k, v [KVH, L, D]: torch's flash kernel, given 4-D tensors (with 3-D
    ones it took its math path, the key heads repeated), reads the keys where they are, strided or not."""
    return F.scaled_dot_product_attention(q[None], k[None], v[None], scale=scale, enable_gqa=True)[0]


def _with_lse(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
              causal: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention and each query's log-sum-exp of its scores ([H, Lq, D], [H, Lq] float32)."""
    group = q.shape[0] // k.shape[0]
    k, v = k.repeat_interleave(group, dim=0), v.repeat_interleave(group, dim=0)
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        q[None], k[None], v[None], 0.0, causal, scale=scale)[:2]
    return out[0], lse[0].float()
