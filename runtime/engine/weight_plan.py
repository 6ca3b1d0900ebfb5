"""Where every weight lives in the engine's one flat weight buffer, in allocation order.

The plan is a pure function of (model config, dtype): the same on the bake machine and at boot. The
loading-optimised layout that faas-build writes stores exactly these bytes at exactly these offsets, so a
load is a few large sequential copies. Fused engine tensors (qkv_proj, gate_up_proj) name the Hugging Face
tensors they are stacked from (along dim 0), which is how a plain Hugging Face directory is loaded too.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING

from runtime.engine.model_config import ModelConfig

if TYPE_CHECKING:
    import torch

ALIGNMENT = 4096

#: bytes per element of each weight dtype; torch is not imported for it, so a manifest can be read without
#: torch (the CUDA restore helper streams weights and must start fast)
ITEMSIZES = {"float32": 4, "bfloat16": 2, "float16": 2}


@dataclass(frozen=True)
class SourceSlice:
    """Rows [row, row + rows) of a planned tensor come from the Hugging Face tensor `name`."""

    name: str
    row: int
    rows: int


@dataclass(frozen=True)
class PlannedTensor:
    name: str
    shape: tuple[int, ...]
    offset: int
    nbytes: int
    sources: tuple[SourceSlice, ...]


@dataclass(frozen=True)
class WeightPlan:
    dtype: str
    alignment: int
    total_bytes: int
    tensors: tuple[PlannedTensor, ...]

    def by_name(self) -> dict[str, PlannedTensor]:
        return {t.name: t for t in self.tensors}

    def source_names(self) -> list[str]:
        return [s.name for t in self.tensors for s in t.sources]

    def as_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, raw: dict) -> "WeightPlan":
        tensors = tuple(
            PlannedTensor(t["name"], tuple(t["shape"]), t["offset"], t["nbytes"],
                          tuple(SourceSlice(**s) for s in t["sources"]))
            for t in raw["tensors"])
        return cls(raw["dtype"], raw["alignment"], raw["total_bytes"], tensors)


def plan_weights(config: ModelConfig, dtype: str, alignment: int = ALIGNMENT) -> WeightPlan:
    itemsize = ITEMSIZES[dtype]
    tensors: list[PlannedTensor] = []
    offset = 0

    def add(name: str, shape: tuple[int, ...], *sources: tuple[str, int]) -> None:
        nonlocal offset
        slices, row = [], 0
        for source_name, rows in sources or ((name, shape[0]),):
            slices.append(SourceSlice(source_name, row, rows))
            row += rows
        assert row == shape[0], (name, shape, sources)
        nbytes = math.prod(shape) * itemsize
        tensors.append(PlannedTensor(name, shape, offset, nbytes, tuple(slices)))
        offset += -(-nbytes // alignment) * alignment

    c = config
    add("model.embed_tokens.weight", (c.vocab_size, c.hidden_size))
    for i in range(c.num_layers):
        p = f"model.layers.{i}"
        add(f"{p}.input_layernorm.weight", (c.hidden_size,))
        qkv = (f"{p}.self_attn.q_proj", c.q_size), (f"{p}.self_attn.k_proj", c.kv_size), \
              (f"{p}.self_attn.v_proj", c.kv_size)
        add(f"{p}.self_attn.qkv_proj.weight", (c.q_size + 2 * c.kv_size, c.hidden_size),
            *[(f"{n}.weight", rows) for n, rows in qkv])
        if c.qkv_bias:
            add(f"{p}.self_attn.qkv_proj.bias", (c.q_size + 2 * c.kv_size,),
                *[(f"{n}.bias", rows) for n, rows in qkv])
        if c.qk_norm:
            add(f"{p}.self_attn.q_norm.weight", (c.head_dim,))
            add(f"{p}.self_attn.k_norm.weight", (c.head_dim,))
        add(f"{p}.self_attn.o_proj.weight", (c.hidden_size, c.q_size))
        add(f"{p}.post_attention_layernorm.weight", (c.hidden_size,))
        add(f"{p}.mlp.gate_up_proj.weight", (2 * c.intermediate_size, c.hidden_size),
            (f"{p}.mlp.gate_proj.weight", c.intermediate_size), (f"{p}.mlp.up_proj.weight", c.intermediate_size))
        add(f"{p}.mlp.down_proj.weight", (c.hidden_size, c.intermediate_size))
    add("model.norm.weight", (c.hidden_size,))
    if not c.tie_word_embeddings:
        add("lm_head.weight", (c.vocab_size, c.hidden_size))
    return WeightPlan(dtype, alignment, offset, tuple(tensors))


def torch_dtype(name: str) -> "torch.dtype":
    import torch

    return getattr(torch, name)


def tensor_views(buffer: "torch.Tensor", plan: WeightPlan) -> dict[str, "torch.Tensor"]:
    """Typed views into the flat uint8 weight buffer, one per planned tensor."""
    dtype = torch_dtype(plan.dtype)
    return {t.name: buffer[t.offset:t.offset + t.nbytes].view(dtype).view(t.shape) for t in plan.tensors}
