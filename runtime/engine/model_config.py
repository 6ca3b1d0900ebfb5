"""The model's shape, read from a Hugging Face config.json, for the Llama family the engine runs."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

#: architectures name -> what differs from plain Llama
SUPPORTED_ARCHITECTURES = {
    "LlamaForCausalLM": {},
    "MistralForCausalLM": {},
    "Qwen2ForCausalLM": {"qkv_bias": True},
    "Qwen3ForCausalLM": {"qk_norm": True},
}


class UnsupportedModel(ValueError):
    """The model cannot be served by this engine; the message says what and why."""


@dataclass(frozen=True)
class RopeScaling:
    """Llama 3's frequency-dependent rope scaling (`rope_type: llama3`)."""

    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_position_embeddings: int


@dataclass(frozen=True)
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: RopeScaling | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool
    qk_norm: bool
    torch_dtype: str

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dir(cls, model_dir: str | Path) -> "ModelConfig":
        path = Path(model_dir) / "config.json"
        try:
            raw = json.loads(path.read_text())
        except FileNotFoundError:
            raise UnsupportedModel(f"{model_dir} has no config.json") from None
        return cls.from_hf(raw)

    @classmethod
    def from_hf(cls, raw: dict[str, Any]) -> "ModelConfig":
        archs = raw.get("architectures") or []
        arch = archs[0] if archs else raw.get("model_type", "unknown")
        if arch not in SUPPORTED_ARCHITECTURES:
            names = ", ".join(SUPPORTED_ARCHITECTURES)
            raise UnsupportedModel(f"architecture {arch!r} is not supported (supported: {names})")
        if arch == "MistralForCausalLM" and raw.get("sliding_window"):
            raise UnsupportedModel(
                f"MistralForCausalLM with sliding_window={raw['sliding_window']} is not supported "
                "(only Mistral models without a sliding window are)")
        traits = SUPPORTED_ARCHITECTURES[arch]
        num_heads = raw["num_attention_heads"]
        hidden = raw["hidden_size"]
        return cls(
            architecture=arch,
            vocab_size=raw["vocab_size"],
            hidden_size=hidden,
            intermediate_size=raw["intermediate_size"],
            num_layers=raw["num_hidden_layers"],
            num_heads=num_heads,
            num_kv_heads=raw.get("num_key_value_heads") or num_heads,
            head_dim=raw.get("head_dim") or hidden // num_heads,
            rms_norm_eps=raw.get("rms_norm_eps", 1e-6),
            rope_theta=float(raw.get("rope_theta", (raw.get("rope_parameters") or {}).get("rope_theta", 10000.0))),
            rope_scaling=_rope_scaling(raw),
            max_position_embeddings=raw.get("max_position_embeddings", 4096),
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            qkv_bias=traits.get("qkv_bias", bool(raw.get("attention_bias", False))),
            qk_norm=traits.get("qk_norm", False),
            torch_dtype=str(raw.get("torch_dtype") or raw.get("dtype") or "float32"),
        )


def _rope_scaling(raw: dict[str, Any]) -> RopeScaling | None:
    scaling = raw.get("rope_scaling") or raw.get("rope_parameters")
    if not scaling:
        return None
    kind = scaling.get("rope_type") or scaling.get("type") or "default"
    if kind == "default":
        return None
    if kind != "llama3":
        raise UnsupportedModel(f"rope scaling {kind!r} is not supported (supported: llama3)")
    return RopeScaling(
        factor=float(scaling["factor"]),
        low_freq_factor=float(scaling["low_freq_factor"]),
        high_freq_factor=float(scaling["high_freq_factor"]),
        original_max_position_embeddings=int(scaling["original_max_position_embeddings"]),
    )
