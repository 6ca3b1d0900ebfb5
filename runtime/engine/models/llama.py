"""The Llama family in one config-driven module: Llama 2/3, Mistral, Qwen2 (qkv bias), Qwen3 (q/k norm).

Built on the meta device (no memory, no initialisation); the model runner then binds every parameter to
its view in the flat weight buffer (runtime/engine/weight_plan.py). Projections are fused (qkv, gate_up)
so a decode step launches few kernels.
"""

from __future__ import annotations

import torch
from torch import nn

from runtime.engine.attention_metadata import AttentionMetadata
from runtime.engine.layers.attention import RopeRows, paged_attention, rotate_and_store_kv
from runtime.engine.layers.dispatch import use_kernels
from runtime.engine.layers.linear import Embedding, Linear, linear
from runtime.engine.layers.norm import RMSNorm
from runtime.engine.layers.rotary import rotary_rows
from runtime.engine.model_config import ModelConfig

KVCache = tuple[torch.Tensor, torch.Tensor]


class Attention(nn.Module):
    def __init__(self, c: ModelConfig) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = c.num_heads, c.num_kv_heads, c.head_dim
        self.q_size, self.kv_size = c.q_size, c.kv_size
        self.scale = c.head_dim ** -0.5
        self.qkv_proj = Linear(c.hidden_size, c.q_size + 2 * c.kv_size, bias=c.qkv_bias)
        self.o_proj = Linear(c.q_size, c.hidden_size, bias=False)
        self.qk_norm = c.qk_norm
        if c.qk_norm:
            self.q_norm = RMSNorm(c.head_dim, c.rms_norm_eps)
            self.k_norm = RMSNorm(c.head_dim, c.rms_norm_eps)

    def forward(self, positions: torch.Tensor, x: torch.Tensor, meta: AttentionMetadata, kv_cache: KVCache,
                cos_sin: torch.Tensor, rope_rows: RopeRows | None = None) -> torch.Tensor:
        qkv = self.qkv_proj(x)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(-1, self.num_heads, self.head_dim)
        k = k.view(-1, self.num_kv_heads, self.head_dim)
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = rotate_and_store_kv(q, k, v, positions, cos_sin, kv_cache[0], kv_cache[1], meta.slot_mapping,
                                   rope_rows)
        out = paged_attention(q, kv_cache[0], kv_cache[1], meta, self.scale, (k, v))
        return self.o_proj(out.reshape(-1, self.q_size))


class MLP(nn.Module):
    def __init__(self, c: ModelConfig) -> None:
        super().__init__()
        self.gate_up_proj = Linear(c.hidden_size, 2 * c.intermediate_size, bias=False)
        self.down_proj = Linear(c.intermediate_size, c.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj.gated(self.gate_up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, c: ModelConfig) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.self_attn = Attention(c)
        self.post_attention_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.mlp = MLP(c)

    def forward(self, positions, x, residual, meta, kv_cache, cos_sin, rope_rows=None):
        if residual is None:
            residual, x = x, self.input_layernorm(x)
        else:
            x, residual = self.input_layernorm(x, residual)
        x = self.self_attn(positions, x, meta, kv_cache, cos_sin, rope_rows)
        x, residual = self.post_attention_layernorm(x, residual)
        return self.mlp(x), residual


class LlamaModel(nn.Module):
    def __init__(self, c: ModelConfig) -> None:
        super().__init__()
        self.embed_tokens = Embedding(c.vocab_size, c.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(c) for _ in range(c.num_layers))
        self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps)


class LlamaForCausalLM(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.model = LlamaModel(config)
        self.lm_head = Linear(config.hidden_size, config.vocab_size, bias=False)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                kv_caches: list[KVCache], cos_sin: torch.Tensor, num_layers: int | None = None) -> torch.Tensor:
        """Hidden states after the final norm, [T, hidden]. `num_layers` runs only the first layers
        (used to load every kernel module a full forward needs, cheaply)."""
        x = self.model.embed_tokens(input_ids)
        # on cpu each token's rotary rows are gathered once for every layer (the cuda kernel reads the table)
        rope_rows = None if use_kernels(x) else rotary_rows(positions, cos_sin, x.dtype)
        residual = None
        for i, layer in enumerate(self.model.layers[:num_layers]):
            x, residual = layer(positions, x, residual, meta, kv_caches[i], cos_sin, rope_rows)
        x, _ = self.model.norm(x, residual)
        return x

    def compute_logits(self, hidden: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        return self.lm_head(hidden) if out is None else linear(hidden, self.lm_head.weight, out=out)


def build_on_meta(config: ModelConfig) -> LlamaForCausalLM:
    """The model's structure with no storage behind it: milliseconds even for 8B."""
    with torch.device("meta"):
        return LlamaForCausalLM(config).eval().requires_grad_(False)


def bind_weights(model: LlamaForCausalLM, views: dict[str, torch.Tensor]) -> None:
    """Point every parameter at its view in the weight buffer (tied lm_head shares the embedding)."""
    if "lm_head.weight" not in views:
        views = {**views, "lm_head.weight": views["model.embed_tokens.weight"]}
    for name, view in views.items():
        module_name, _, attr = name.rpartition(".")
        setattr(model.get_submodule(module_name), attr, nn.Parameter(view, requires_grad=False))
    unbound = [n for n, p in model.named_parameters(remove_duplicate=False) if p.is_meta]
    if unbound:
        raise RuntimeError(f"parameters without weights: {unbound[:5]}")
