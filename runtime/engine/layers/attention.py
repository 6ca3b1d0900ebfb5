"""Paged attention: new keys and values go into the block-paged KV cache, then every query token attends
causally to its sequence's cached tokens.

One code path serves prefill, decode, mixed batches and recomputation after preemption: tokens of a step are
flattened into one batch, and each sequence's slice of it is described by `query_start_loc` (where its new
tokens start), `seq_lens` (its total length after this step) and its row of `block_tables`.
On cuda the attention is a Triton kernel (runtime/engine/kernels/paged_attention.py), on cpu torch's fused
attention without masks (runtime/engine/cpu/attention.py); both are tested against this module's plain
PyTorch reference.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from runtime.engine.attention_metadata import AttentionMetadata
from runtime.engine.cpu.attention import paged_attention_cpu
from runtime.engine.layers.dispatch import use_kernels
from runtime.engine.layers.rotary import apply_rotary

RopeRows = tuple[torch.Tensor, torch.Tensor]


def rotate_and_store_kv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor,
                        cos_sin: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor,
                        rope_rows: RopeRows | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The rotary embedding of q and k, then k and v into their slots of the cache; returns q and k rotated.
    On cuda one kernel, in place (runtime/engine/kernels/rotary.py): one launch fewer per layer."""
    if use_kernels(q):
        from runtime.engine.kernels.rotary import rotary_store_kv

        rotary_store_kv(q, k, v, positions, cos_sin, k_cache, v_cache, slot_mapping)
        return q, k
    q, k = apply_rotary(q, k, positions, cos_sin, rope_rows)
    store_kv(k, v, k_cache, v_cache, slot_mapping)
    return q, k


def store_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """k, v: [T, kv_heads, head_dim]; caches: [num_blocks, block_size, kv_heads, head_dim]."""
    flat_k = k_cache.view(-1, *k_cache.shape[2:])
    flat_v = v_cache.view(-1, *v_cache.shape[2:])
    flat_k.index_copy_(0, slot_mapping, k.to(flat_k.dtype))
    flat_v.index_copy_(0, slot_mapping, v.to(flat_v.dtype))


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    meta: AttentionMetadata, scale: float,
                    new_kv: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """q: [T, heads, head_dim] -> [T, heads, head_dim]. `new_kv`: the step's keys and values, just stored
    (the cpu path reads a whole prompt's from there rather than from the cache)."""
    if use_kernels(q):
        from runtime.engine.kernels.paged_attention import paged_attention as kernel

        return kernel(q, k_cache, v_cache, meta, scale)
    return paged_attention_cpu(q, k_cache, v_cache, meta, scale, new_kv)


def paged_attention_reference(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                              meta: AttentionMetadata, scale: float) -> torch.Tensor:
    starts = meta.query_start_loc_cpu or meta.query_start_loc.tolist()
    lens = meta.seq_lens_cpu or meta.seq_lens.tolist()
    block_size = k_cache.shape[1]
    group = q.shape[1] // k_cache.shape[2]
    out = torch.empty_like(q)
    for i, seq_len in enumerate(lens):
        q_seq = q[starts[i]:starts[i + 1]]                      # [Lq, H, D]
        num_q = q_seq.shape[0]
        blocks = meta.block_tables[i, : -(-seq_len // block_size)].long()
        keys = k_cache[blocks].flatten(0, 1)[:seq_len]          # [L, KVH, D]
        values = v_cache[blocks].flatten(0, 1)[:seq_len]
        keys = keys.repeat_interleave(group, dim=1).transpose(0, 1)   # [H, L, D]
        values = values.repeat_interleave(group, dim=1).transpose(0, 1)
        positions = torch.arange(seq_len - num_q, seq_len)
        visible = torch.arange(seq_len)[None, :] <= positions[:, None]  # [Lq, L]
        attended = F.scaled_dot_product_attention(
            q_seq.transpose(0, 1), keys.to(q.dtype), values.to(q.dtype), attn_mask=visible, scale=scale)
        out[starts[i]:starts[i + 1]] = attended.transpose(0, 1)
    return out
