"""Rotary position embeddings (the rotate-half convention of Hugging Face checkpoints), incl. llama3 scaling."""

from __future__ import annotations

import math

import torch

from runtime.engine.model_config import ModelConfig, RopeScaling


def inverse_frequencies(head_dim: int, theta: float, scaling: RopeScaling | None) -> torch.Tensor:
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    if scaling is None:
        return inv_freq
    # Llama 3.1: long wavelengths are slowed down by `factor`, short ones kept, the band between blended.
    old_len = scaling.original_max_position_embeddings
    low_wavelen = old_len / scaling.low_freq_factor
    high_wavelen = old_len / scaling.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / scaling.factor, inv_freq)
    smooth = (old_len / wavelen - scaling.low_freq_factor) / (scaling.high_freq_factor - scaling.low_freq_factor)
    blended = (1 - smooth) * scaled / scaling.factor + smooth * scaled
    medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
    return torch.where(medium, blended, scaled)


def rope_table(c: ModelConfig, max_positions: int) -> torch.Tensor:
    """The model's cos/sin table for MAX_POSITIONS positions, on the host."""
    return cos_sin_table(max_positions, inverse_frequencies(c.head_dim, c.rope_theta, c.rope_scaling))


def cos_sin_table(max_positions: int, inv_freq: torch.Tensor) -> torch.Tensor:
    """[max_positions, head_dim] float32: cos of each frequency in the first half, sin in the second."""
    freqs = torch.outer(torch.arange(max_positions, dtype=torch.float32), inv_freq)
    return torch.cat([freqs.cos(), freqs.sin()], dim=-1)


def apply_rotary(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor,
                 rows: tuple[torch.Tensor, torch.Tensor] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """q: [T, heads, head_dim], k: [T, kv_heads, head_dim] -> new tensors (the kernels' path rotates them in
    place, together with the KV write: layers/attention.py). `rows` (from `rotary_rows`, gathered once a step
    for every layer) saves gathering the tokens' rows again."""
    cos, sin = rows if rows is not None else rotary_rows(positions, cos_sin, q.dtype)
    heads = q.shape[1]
    rotated = _rotate(_joined(q, k), cos, sin)
    return rotated[:, :heads], rotated[:, heads:]


def rotary_rows(positions: torch.Tensor, cos_sin: torch.Tensor,
                dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Each token's cos, and its sin with the first half negated (the sign of rotate-half's first half), both
    repeated to the head dim, [T, 1, head_dim] each, in `dtype`."""
    half = cos_sin.shape[-1] // 2
    table = cos_sin[positions]
    cos = torch.cat([table[:, :half]] * 2, dim=-1)[:, None, :].to(dtype)
    sin = torch.cat([-table[:, half:], table[:, half:]], dim=-1)[:, None, :].to(dtype)
    return cos, sin


def _rotate(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """x * cos + rotate_half(x) * sin, bit for bit, in four ops instead of five: rotate_half(x) = (-x2, x1), and
    (-x2) * sin equals x2 * (-sin) exactly, so the halves are swapped and the sign comes from `signed_sin`.
    On the CPU each op over a prompt's tokens is a parallel region that waits for all of torch's threads."""
    half = x.shape[-1] // 2
    swapped = torch.cat((x[..., half:], x[..., :half]), dim=-1)
    return (x * cos).add_(swapped.mul_(signed_sin))


def _joined(q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """q and k as one [T, heads + kv_heads, head_dim] tensor, rotated at once: a view where k's heads follow
    q's in every row of one buffer (the fused qkv projection's output), else a copy."""
    tokens, heads, dim = q.shape
    width = (heads + k.shape[1]) * dim
    row = q.stride(0) if tokens > 1 else width  # one token's row stride says nothing
    follows = (k.dtype == q.dtype and k.shape[0] == tokens and q.stride()[1:] == k.stride()[1:] == (dim, 1)
               and (tokens == 1 or k.stride(0) == row >= width)
               and q.untyped_storage().data_ptr() == k.untyped_storage().data_ptr()
               and k.data_ptr() == q.data_ptr() + heads * dim * q.element_size())
    if follows:
        return q.as_strided((tokens, heads + k.shape[1], dim), (row, dim, 1))
    return torch.cat([q, k], dim=1)
