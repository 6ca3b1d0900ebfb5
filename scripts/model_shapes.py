"""Hugging Face configs of the real model shapes the GPU benchmarks use (weights are random; shapes are
what cold start and decode speed depend on)."""

from __future__ import annotations

import json
from pathlib import Path

SHAPES = {
    # a few MiB: the weight benchmark's CPU check (scripts/bench_weights.py --device cpu --shapes tiny)
    "tiny": dict(architectures=["LlamaForCausalLM"], model_type="llama", vocab_size=4096, hidden_size=256,
                 intermediate_size=688, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                 max_position_embeddings=2048, rope_theta=10000.0, rms_norm_eps=1e-5,
                 tie_word_embeddings=False, bos_token_id=1, eos_token_id=2),
    "smollm2-135m": dict(architectures=["LlamaForCausalLM"], model_type="llama", vocab_size=49152, hidden_size=576,
                         intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3,
                         max_position_embeddings=8192, rope_theta=100000.0, rms_norm_eps=1e-5,
                         tie_word_embeddings=True, bos_token_id=1, eos_token_id=2),
    "qwen2-1.5b": dict(architectures=["Qwen2ForCausalLM"], model_type="qwen2", vocab_size=151936, hidden_size=1536,
                       intermediate_size=8960, num_hidden_layers=28, num_attention_heads=12, num_key_value_heads=2,
                       max_position_embeddings=131072, rope_theta=1000000.0, rms_norm_eps=1e-6,
                       tie_word_embeddings=True, sliding_window=None, use_sliding_window=False,
                       bos_token_id=151643, eos_token_id=151643),
    "llama-3-8b": dict(architectures=["LlamaForCausalLM"], model_type="llama", vocab_size=128256, hidden_size=4096,
                       intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
                       max_position_embeddings=8192, rope_theta=500000.0, rms_norm_eps=1e-5,
                       tie_word_embeddings=False, bos_token_id=128000, eos_token_id=128001),
}


def write_config_and_tokenizer(out: Path, shape: dict, dtype: str = "bfloat16") -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps({**shape, "torch_dtype": dtype}))
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<|endoftext|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(["The quick brown fox jumps over the lazy dog."] * 20, trainer)
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|endoftext|>"}))


def make_random_model_dir(out: Path, shape: str, seed: int = 0) -> Path:
    """A random-weight bf16 model of a real shape, written as a Hugging Face directory (needs transformers
    and a GPU for the big shapes: initialised on the GPU, seconds even for 8B)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    if (out / "model.safetensors.index.json").exists() or (out / "model.safetensors").exists():
        return out
    write_config_and_tokenizer(out, SHAPES[shape])
    torch.manual_seed(seed)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(out), dtype=torch.bfloat16)
    model.save_pretrained(out)
    del model
    return out
