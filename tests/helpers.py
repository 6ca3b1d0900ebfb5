"""Shared test helpers: tiny random models and engines built on them; the processes a process started."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from runtime.engine import Engine, EngineConfig
from runtime.weights.hf_dir import hf_dir_loader

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


def make_engine(model_dir, **config) -> Engine:
    config.setdefault("device", "cpu")
    engine = Engine.build(model_dir, hf_dir_loader(Path(model_dir)), EngineConfig(**config))
    engine.start()
    return engine


def children_of(pid: int) -> list[int]:
    """The processes PID started that are still its children, as the kernel lists each of its threads'."""
    kids: list[int] = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            kids += [int(p) for p in (task / "children").read_text().split()]
        except FileNotFoundError:  # a thread that ended since the listing
            continue
    return kids


def processes_running(marker: bytes, pids: list[int] | None = None) -> list[int]:
    """Of PIDS (default: every process), those whose command line holds MARKER."""
    found = []
    for pid in pids if pids is not None else [int(p.name) for p in Path("/proc").iterdir() if p.name.isdigit()]:
        try:
            if marker in Path(f"/proc/{pid}/cmdline").read_bytes():
                found.append(pid)
        except OSError:  # it ended since the listing
            continue
    return found
