"""A tiny random Llama with a character-level tokenizer and a ChatML template, for the server tests.

Interim: runtime/engine/random_model.py (make_random_model) replaces this once it lands on main.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file
from tokenizers import Tokenizer, decoders, models

SPECIALS = ["<unk>", "<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def make_tiny_model(out_dir: Path, seed: int = 0, max_positions: int = 4096) -> Path:
    out_dir.mkdir(parents=True, exist_ok=True)
    chars = [chr(c) for c in range(32, 127)] + ["\n"]
    vocab = {t: i for i, t in enumerate(SPECIALS + chars)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    tok.decoder = decoders.Fuse()
    tok.add_special_tokens(SPECIALS)
    tok.save(str(out_dir / "tokenizer.json"))
    (out_dir / "tokenizer_config.json").write_text(json.dumps(
        {"chat_template": CHATML, "eos_token": "<|im_end|>", "bos_token": None, "add_bos_token": False}))
    hidden, inter, layers, heads, kv_heads, vocab_size = 64, 128, 2, 4, 2, 128
    config = {"architectures": ["LlamaForCausalLM"], "vocab_size": vocab_size, "hidden_size": hidden,
              "intermediate_size": inter, "num_hidden_layers": layers, "num_attention_heads": heads,
              "num_key_value_heads": kv_heads, "max_position_embeddings": max_positions,
              "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "tie_word_embeddings": True, "torch_dtype": "float32"}
    (out_dir / "config.json").write_text(json.dumps(config))
    g = torch.Generator().manual_seed(seed)
    head_dim = hidden // heads

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g) * 0.5

    tensors = {"model.embed_tokens.weight": rand(vocab_size, hidden), "model.norm.weight": torch.ones(hidden)}
    for i in range(layers):
        p = f"model.layers.{i}"
        tensors |= {
            f"{p}.input_layernorm.weight": torch.ones(hidden),
            f"{p}.post_attention_layernorm.weight": torch.ones(hidden),
            f"{p}.self_attn.q_proj.weight": rand(heads * head_dim, hidden),
            f"{p}.self_attn.k_proj.weight": rand(kv_heads * head_dim, hidden),
            f"{p}.self_attn.v_proj.weight": rand(kv_heads * head_dim, hidden),
            f"{p}.self_attn.o_proj.weight": rand(hidden, heads * head_dim),
            f"{p}.mlp.gate_proj.weight": rand(inter, hidden),
            f"{p}.mlp.up_proj.weight": rand(inter, hidden),
            f"{p}.mlp.down_proj.weight": rand(hidden, inter),
        }
    save_file(tensors, str(out_dir / "model.safetensors"))
    return out_dir
