"""A GGUF llama model (llama.cpp's single-file format) turned into a Hugging Face model directory.

The GGUF stores quantised tensors under llama.cpp's names, with the q/k rows permuted for its rotary
layout, and the tokenizer as metadata. `import_gguf` dequantises to float32 (Q4_1, Q8_0... values are exact
in float32), renames, undoes the permutation, and writes model.safetensors, config.json,
generation_config.json, tokenizer.json (built with `tokenizers`) and tokenizer_config.json (the chat
template, bos/eos), which the engine then loads like any other model directory.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from runtime.logs import get_logger
from runtime.weights.temps import remove_dead_temps, temp_beside

if TYPE_CHECKING:
    import numpy as np
    from gguf import GGUFReader
    from tokenizers import Tokenizer

log = get_logger("weights")


class GGUFImportError(ValueError):
    """The GGUF file cannot be imported (architecture, tensor or tokenizer this importer does not know)."""


#: llama.cpp's per-block tensor names -> Hugging Face Llama's
_BLOCK_NAMES = {
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj", "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
}
_TOP_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
_BLOCK = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")

#: llama.cpp's token types (llama_token_type)
_CONTROL, _USER_DEFINED = 3, 4


def import_gguf(gguf_path: Path, out_dir: Path, progress: bool = True) -> Path:
    """Write the Hugging Face model directory `out_dir` for the llama GGUF `gguf_path`; returns `out_dir`.
    Written under a temporary name beside it and renamed, so an interrupted import leaves nothing.
    `progress`: draw a bar while dequantising."""
    from gguf import GGUFReader

    gguf_path, out_dir = Path(gguf_path), Path(out_dir)
    reader = GGUFReader(gguf_path)
    meta = _metadata(reader)
    arch = meta.get("general.architecture")
    if arch != "llama":
        raise GGUFImportError(f"{gguf_path.name}: GGUF architecture {arch!r} is not supported (only llama)")
    if "tokenizer.ggml.tokens" not in meta:
        raise GGUFImportError(f"{gguf_path.name} has no tokenizer (no tokenizer.ggml.tokens)")
    config = hf_config(meta, {t.name for t in reader.tensors})
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    remove_dead_temps(out_dir)
    tmp = temp_beside(out_dir)
    shutil.rmtree(tmp, ignore_errors=True)  # this process's own, from an import that failed earlier
    tmp.mkdir()
    try:
        _write_weights(reader, config, tmp / "model.safetensors", progress)
        _write_json(tmp / "config.json", config)
        _write_json(tmp / "generation_config.json", {
            k: config[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id") if k in config})
        build_tokenizer(meta).save(str(tmp / "tokenizer.json"))
        _write_json(tmp / "tokenizer_config.json", tokenizer_config(meta))
        os.rename(tmp, out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out_dir


def imported_model_dir(gguf_path: Path, cache_dir: Path) -> Path:
    """The imported directory of `gguf_path` in `cache_dir`, importing it the first time. The cache key
    is the file's name and size, so a different file (a new wheel) is imported afresh."""
    gguf_path = Path(gguf_path).resolve()
    key = hashlib.sha256(f"{gguf_path.name}:{gguf_path.stat().st_size}".encode()).hexdigest()[:16]
    out_dir = Path(cache_dir) / "gguf" / key / gguf_path.stem
    if (out_dir / "config.json").exists():
        return out_dir
    log.info("importing %s into %s (first start only)", gguf_path, out_dir)
    start = time.perf_counter()
    try:
        import_gguf(gguf_path, out_dir)
    except OSError:
        if not (out_dir / "config.json").exists():  # else another process finished the same import first
            raise
    log.info("imported %s in %.1f s", gguf_path.name, time.perf_counter() - start)
    return out_dir


# -- config ---------------------------------------------------------------------------------------------

def hf_config(meta: dict[str, Any], tensor_names: set[str]) -> dict[str, Any]:
    """config.json of a LlamaForCausalLM from the GGUF's `llama.*` metadata."""
    def need(key: str) -> Any:
        if f"llama.{key}" not in meta:
            raise GGUFImportError(f"GGUF metadata has no llama.{key}")
        return meta[f"llama.{key}"]

    if "rope_freqs.weight" in tensor_names:
        raise GGUFImportError("llama 3 rope scaling (a rope_freqs tensor) is not supported by the GGUF importer")
    if meta.get("llama.expert_count"):
        raise GGUFImportError("mixture-of-experts llama GGUFs are not supported")
    heads = need("attention.head_count")
    hidden = need("embedding_length")
    config = {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_act": "silu",
        "hidden_size": hidden, "intermediate_size": need("feed_forward_length"),
        "num_hidden_layers": need("block_count"), "num_attention_heads": heads,
        "num_key_value_heads": meta.get("llama.attention.head_count_kv", heads),
        "head_dim": meta.get("llama.attention.key_length", hidden // heads),
        "max_position_embeddings": need("context_length"),
        "rms_norm_eps": float(need("attention.layer_norm_rms_epsilon")),
        "rope_theta": float(meta.get("llama.rope.freq_base", 10000.0)),
        "vocab_size": meta.get("llama.vocab_size") or len(meta.get("tokenizer.ggml.tokens", [])),
        "tie_word_embeddings": "output.weight" not in tensor_names,
        "attention_bias": False, "mlp_bias": False, "torch_dtype": "float32",
    }
    scaling = meta.get("llama.rope.scaling.type")
    if scaling == "linear":
        config["rope_scaling"] = {"rope_type": "linear", "factor": float(meta["llama.rope.scaling.factor"])}
    elif scaling not in (None, "none"):
        raise GGUFImportError(f"rope scaling {scaling!r} is not supported by the GGUF importer")
    for name in ("bos", "eos", "padding"):
        token_id = meta.get(f"tokenizer.ggml.{name}_token_id")
        if token_id is not None:
            config[f"{'pad' if name == 'padding' else name}_token_id"] = int(token_id)
    return config


# -- weights --------------------------------------------------------------------------------------------

def hf_tensor_name(gguf_name: str) -> str:
    block = _BLOCK.fullmatch(gguf_name)
    if block and block.group(2) in _BLOCK_NAMES:
        return f"model.layers.{block.group(1)}.{_BLOCK_NAMES[block.group(2)]}.{block.group(3)}"
    stem, _, kind = gguf_name.rpartition(".")
    if stem in _TOP_NAMES:
        return f"{_TOP_NAMES[stem]}.{kind}"
    raise GGUFImportError(f"GGUF tensor {gguf_name!r} has no Hugging Face Llama counterpart")


def unpermute_rotary_rows(weight: "np.ndarray", n_heads: int) -> "np.ndarray":
    """Undo convert_hf_to_gguf's `permute` of q/k rows: llama.cpp pairs rotary halves per head as
    interleaved rows, Hugging Face keeps each head's two halves apart."""
    rows = weight.shape[0]
    return (weight.reshape(n_heads, rows // n_heads // 2, 2, *weight.shape[1:])
            .swapaxes(1, 2).reshape(weight.shape))


def _write_weights(reader: "GGUFReader", config: dict[str, Any], path: Path, progress: bool) -> None:
    import numpy as np
    from gguf.quants import dequantize
    from safetensors.numpy import save_file
    from tqdm import tqdm

    heads = {"self_attn.q_proj": config["num_attention_heads"], "self_attn.k_proj": config["num_key_value_heads"]}
    tensors = {}
    for t in tqdm(reader.tensors, desc="dequantising", unit="tensor", leave=False, disable=not progress):
        name = hf_tensor_name(t.name)
        weight = np.asarray(dequantize(t.data, t.tensor_type), dtype=np.float32)
        # shape is GGUF order (fastest dimension first); numpy's is the reverse
        weight = weight.reshape([int(d) for d in reversed(t.shape)])
        for module, n in heads.items():
            if f".{module}." in name:
                weight = unpermute_rotary_rows(weight, n)
        tensors[name] = np.ascontiguousarray(weight)
    save_file(tensors, str(path), metadata={"format": "pt", "source": "gguf"})


# -- tokenizer ------------------------------------------------------------------------------------------

def _digits_then_gpt2():
    from tokenizers import pre_tokenizers

    # SmolLM, StarCoder...: every digit alone, then GPT-2's regex (their tokenizer.json says exactly this)
    return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True),
                                    pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)])


def _gpt2():
    from tokenizers import pre_tokenizers

    return pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)


def _llama3():
    from tokenizers import Regex, pre_tokenizers

    split = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
             r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
    return pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(split), behavior="isolated"),
                                    pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])


#: `tokenizer.ggml.pre` -> the Hugging Face pre-tokenizer that splits text as llama.cpp's regexes for it do
#: (llama-vocab.cpp), i.e. as the model's original tokenizer.json did
PRE_TOKENIZERS = {
    "smollm": _digits_then_gpt2, "starcoder": _digits_then_gpt2, "refact": _digits_then_gpt2,
    "codeshell": _digits_then_gpt2, "gpt-2": _gpt2, "default": _gpt2,
    "llama-bpe": _llama3, "llama3": _llama3, "smaug-bpe": _llama3, "dbrx": _llama3,
}


def build_tokenizer(meta: dict[str, Any]) -> "Tokenizer":
    """tokenizer.json from the GGUF vocabulary: byte-level BPE with its merges, control tokens as special
    added tokens, user-defined ones as plain added tokens."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, processors

    kind = meta.get("tokenizer.ggml.model")
    if kind != "gpt2":
        raise GGUFImportError(f"GGUF tokenizer {kind!r} is not supported (only byte-level BPE, 'gpt2')")
    pre = meta.get("tokenizer.ggml.pre", "default")
    if pre not in PRE_TOKENIZERS:
        raise GGUFImportError(f"GGUF pre-tokenizer {pre!r} is not supported (supported: {', '.join(PRE_TOKENIZERS)})")
    tokens = meta["tokenizer.ggml.tokens"]
    merges = [tuple(m.split(" ", 1)) for m in meta.get("tokenizer.ggml.merges", [])]
    tok = Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=merges, fuse_unk=False))
    tok.pre_tokenizer = PRE_TOKENIZERS[pre]()
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    types = meta.get("tokenizer.ggml.token_type") or []
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False)
                            for t, token_type in zip(tokens, types) if token_type == _CONTROL])
    tok.add_tokens([AddedToken(t, special=False, normalized=False)
                    for t, token_type in zip(tokens, types) if token_type == _USER_DEFINED])
    return tok


def tokenizer_config(meta: dict[str, Any]) -> dict[str, Any]:
    tokens = meta["tokenizer.ggml.tokens"]
    config: dict[str, Any] = {
        "tokenizer_class": "GPT2Tokenizer", "clean_up_tokenization_spaces": False,
        "add_bos_token": bool(meta.get("tokenizer.ggml.add_bos_token", False)),
        "add_eos_token": bool(meta.get("tokenizer.ggml.add_eos_token", False)),
        "model_max_length": meta.get("llama.context_length"),
    }
    for name, key in (("bos", "bos"), ("eos", "eos"), ("unk", "unknown"), ("pad", "padding")):
        token_id = meta.get(f"tokenizer.ggml.{key}_token_id")
        if token_id is not None:
            config[f"{name}_token"] = tokens[token_id]
    if "tokenizer.chat_template" in meta:
        config["chat_template"] = meta["tokenizer.chat_template"]
    return config


# -- reading --------------------------------------------------------------------------------------------

def _metadata(reader: "GGUFReader") -> dict[str, Any]:
    return {name: field.contents() for name, field in reader.fields.items()}


def _write_json(path: Path, value: dict[str, Any]) -> None:
    path.write_text(json.dumps(value, indent=2, ensure_ascii=False) + "\n")
