"""Text to token ids and back, and chat messages to a prompt through the model's own chat template."""

from __future__ import annotations

import datetime
import json
import re
from functools import cached_property
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer as _HFTokenizer


class ChatTemplateError(ValueError):
    """The messages cannot be rendered by the model's chat template (or it has none)."""


class Tokenizer:
    def __init__(self, model_dir: str | Path) -> None:
        model_dir = Path(model_dir)
        path = model_dir / "tokenizer.json"
        if not path.exists():
            raise FileNotFoundError(f"{model_dir} has no tokenizer.json")
        self._tok = _HFTokenizer.from_file(str(path))
        config = _read_json(model_dir / "tokenizer_config.json")
        generation = _read_json(model_dir / "generation_config.json")
        self.chat_template: str | None = config.get("chat_template")
        template_file = model_dir / "chat_template.jinja"
        if template_file.exists():
            self.chat_template = template_file.read_text()
        if isinstance(self.chat_template, list):  # [{"name": "default", "template": ...}, ...]
            named = {t["name"]: t["template"] for t in self.chat_template}
            self.chat_template = named.get("default") or next(iter(named.values()))
        self.bos_token = _token_text(config.get("bos_token"))
        self.eos_token = _token_text(config.get("eos_token"))
        self.add_bos_token = bool(config.get("add_bos_token", False))
        self.bos_token_id = self._tok.token_to_id(self.bos_token) if self.bos_token else None
        eos_ids = generation.get("eos_token_id", config.get("eos_token_id"))
        if eos_ids is None and self.eos_token:
            eos_ids = self._tok.token_to_id(self.eos_token)
        self.eos_token_ids: set[int] = set(eos_ids if isinstance(eos_ids, list) else
                                           [] if eos_ids is None else [eos_ids])
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        # encode_batch, not encode: it lets go of the GIL (encode holds it for the seconds a megabyte takes,
        # and the server's event loop would stand still meanwhile)
        ids = self._tok.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids
        if (add_special_tokens and self.add_bos_token and self.bos_token_id is not None
                and (not ids or ids[0] != self.bos_token_id)):
            ids = [self.bos_token_id] + ids
        return ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(ids, skip_special_tokens=skip_special_tokens)

    def token_text(self, token_id: int) -> str:
        """The text of one token on its own (for logprobs), with special tokens shown."""
        return self._tok.decode([token_id], skip_special_tokens=False)

    @property
    def grammar_eos_token_id(self) -> int | None:
        """The end-of-sequence token a finished grammar allows: the tokenizer's own EOS where it is one of the
        model's, else the lowest of them (any of them ends the sequence)."""
        own = self._tok.token_to_id(self.eos_token) if self.eos_token else None
        return own if own in self.eos_token_ids else min(self.eos_token_ids, default=None)

    def to_json(self) -> str:
        """The tokenizer as tokenizer.json holds it (the grammar engine builds its token table from it)."""
        return self._tok.to_str()

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes one token stands for, a part of a UTF-8 character included (logprobs' `bytes`): the
        token's string in the byte-level alphabet mapped back to bytes; an added token's own text."""
        piece = self._tok.id_to_token(token_id)
        if piece is None:
            return b""
        if token_id in self._added_ids:
            return piece.encode()
        if _BYTE_FALLBACK.fullmatch(piece):  # SentencePiece's <0xE2>
            return bytes([int(piece[3:5], 16)])
        if all(ch in _BYTE_OF for ch in piece):
            return bytes(_BYTE_OF[ch] for ch in piece)
        return piece.replace("\u2581", " ").encode()  # SentencePiece's word marker

    @cached_property
    def _added_ids(self) -> set[int]:
        return set(self._tok.get_added_tokens_decoder())

    @cached_property
    def special_ids(self) -> set[int]:
        return {t.content and self._tok.token_to_id(t.content)
                for t in self._tok.get_added_tokens_decoder().values() if t.special} - {None}

    def apply_chat_template(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
                            tools: list[dict[str, Any]] | None = None) -> str:
        if not self.chat_template:
            raise ChatTemplateError("this model has no chat template; use /v1/completions")
        extra = {"tools": tools} if tools else {}  # templates test `tools is defined` as well as its value
        try:
            return self._compiled_template.render(
                messages=messages, add_generation_prompt=add_generation_prompt,
                bos_token=self.bos_token or "", eos_token=self.eos_token or "", **extra)
        except ChatTemplateError:
            raise
        except Exception as exc:  # jinja errors, template's own checks
            raise ChatTemplateError(f"chat template failed: {exc}") from None

    @cached_property
    def _compiled_template(self):
        # Imported here: only chat requests need jinja2, and it is not free to import on the start path.
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        def raise_exception(message: str) -> None:
            raise ChatTemplateError(message)

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        env.filters["tojson"] = lambda value, indent=None: json.dumps(value, indent=indent, ensure_ascii=False)
        env.globals["raise_exception"] = raise_exception
        env.globals["strftime_now"] = lambda fmt: datetime.datetime.now().strftime(fmt)
        return env.from_string(self.chat_template)


def _byte_level_alphabet() -> dict[str, int]:
    """GPT-2's byte-level alphabet, character -> byte: printable bytes stand for themselves, the others
    (controls, space, 0x7F-0xA0, 0xAD) for the characters from U+0100 on, in byte order."""
    printable = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    others = [b for b in range(256) if b not in printable]
    return {chr(b): b for b in printable} | {chr(0x100 + i): b for i, b in enumerate(others)}


_BYTE_OF = _byte_level_alphabet()
_BYTE_FALLBACK = re.compile(r"<0x[0-9A-Fa-f]{2}>")


def _read_json(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text()) if path.exists() else {}


def _token_text(token: Any) -> str | None:
    if isinstance(token, dict):  # {"content": "<s>", ...} in older tokenizer_config files
        return token.get("content")
    return token
