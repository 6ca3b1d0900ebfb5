"""Shared test helpers: tiny random models and engines built on them."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open

from runtime.engine import Engine, EngineConfig
from runtime.engine.weight_plan import tensor_views

_COMMON = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=2, max_position_embeddings=512, rms_norm_eps=1e-5)


def tiny_model_dir(out: Path, preset: str) -> str:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import (LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM, Qwen3Config,
                              Qwen3ForCausalLM)

    torch.manual_seed(0)
    if preset == "tiny-llama":
        model = LlamaForCausalLM(LlamaConfig(**_COMMON, tie_word_embeddings=False, rope_scaling={
            "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64}))
    elif preset == "tiny-qwen2":
        model = Qwen2ForCausalLM(Qwen2Config(**_COMMON, tie_word_embeddings=True))
    else:
        model = Qwen3ForCausalLM(Qwen3Config(**_COMMON, head_dim=32, tie_word_embeddings=False))
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.3) if p.dim() > 1 else p.uniform_(0.5, 1.5)
    model.save_pretrained(out)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=["<|endoftext|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    corpus = ["The quick brown fox jumps over the lazy dog.", "Hello world, this is a test.",
              "Paris is the capital of France. Ünïcödé and 日本語 too."] * 10
    tok.train_from_iterator(corpus, trainer)
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|endoftext|>"}))
    return str(out)


class _Loaded:
    def wait(self) -> None:
        return None


def load_hf_dir(model_dir):
    def load(plan, buffer):
        views = tensor_views(buffer, plan)
        handles = {}
        for f in Path(model_dir).glob("*.safetensors"):
            h = safe_open(str(f), "pt")
            handles.update({k: h for k in h.keys()})
        for t in plan.tensors:
            for s in t.sources:
                views[t.name][s.row:s.row + s.rows].copy_(handles[s.name].get_tensor(s.name))
        return _Loaded()

    return load


def make_engine(model_dir, **config) -> Engine:
    config.setdefault("device", "cpu")
    engine = Engine.build(model_dir, load_hf_dir(model_dir), EngineConfig(**config))
    engine.start()
    return engine
