"""Grammar-constrained decoding through llguidance: a request's grammar (a JSON schema or a Lark grammar)
becomes a matcher that says, before each token, which tokens may come next, and follows the tokens chosen.

llguidance is imported on the first request that uses a grammar, never on the start path. A grammar is
compiled once per distinct source and kept (least recently used first out); each request gets a copy of
the compiled matcher, which costs microseconds.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from runtime.engine.sampling_params import GrammarSpec, InvalidParams

if TYPE_CHECKING:
    from runtime.engine.tokenizer import Tokenizer

#: compiled grammars kept; a compiled JSON schema is tens of kilobytes
CACHE_SIZE = 256
#: JSON as Python's json.dumps writes it: ", " and ": ", and no other whitespace. Free whitespace lets a
#: weak model fill max_tokens with spaces and newlines before the first key.
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


class GrammarCompiler:
    """Compiles grammars for one tokenizer and hands out matchers (thread-safe: the server compiles, the
    engine thread matches)."""

    def __init__(self, tokenizer: "Tokenizer", vocab_size: int) -> None:
        self._tokenizer = tokenizer
        self._vocab_size = vocab_size
        self._ll_tokenizer: Any = None
        self._compiled: OrderedDict[GrammarSpec, Any] = OrderedDict()
        self._lock = threading.Lock()

    def matcher(self, spec: GrammarSpec) -> "Matcher":
        """A fresh matcher for `spec`; raises InvalidParams (naming spec.param) when the grammar is invalid."""
        with self._lock:
            compiled = self._compiled.get(spec)
            if compiled is not None:
                self._compiled.move_to_end(spec)
        if compiled is None:
            compiled = self._compile(spec)
            with self._lock:
                self._compiled[spec] = compiled
                while len(self._compiled) > CACHE_SIZE:
                    self._compiled.popitem(last=False)
        return Matcher(compiled.deep_copy())

    def _compile(self, spec: GrammarSpec) -> Any:
        from llguidance import LLMatcher

        try:
            if spec.kind == "json_schema":
                grammar = LLMatcher.grammar_from_json_schema(spec.source, defaults=JSON_OPTIONS)
            elif spec.kind == "lark":
                grammar = LLMatcher.grammar_from_lark(spec.source)
            elif spec.kind == "regex":
                grammar = LLMatcher.grammar_from_regex(spec.source)
            elif spec.kind == "grammar":  # Lark or llama.cpp's GBNF
                from llguidance.gbnf_to_lark import GbnfToLarkError, any_to_lark

                try:
                    grammar = LLMatcher.grammar_from_lark(any_to_lark(spec.source))
                except GbnfToLarkError as exc:
                    raise ValueError(str(exc)) from None
            else:
                raise ValueError(f"unknown grammar kind {spec.kind!r}")
        except ValueError as exc:
            raise InvalidParams(spec.param, f"invalid {spec.param}: {exc}") from None
        tokenizer = self._llg_tokenizer()
        is_error, messages = LLMatcher.validate_grammar_with_warnings(grammar, tokenizer)
        if is_error:
            raise InvalidParams(spec.param, f"invalid {spec.param}: {'; '.join(messages)}")
        matcher = LLMatcher(tokenizer, grammar, log_level=0)
        if matcher.is_error():
            raise InvalidParams(spec.param, f"invalid {spec.param}: {matcher.get_error()}")
        return matcher

    def _llg_tokenizer(self) -> Any:
        with self._lock:
            if self._ll_tokenizer is None:
                from llguidance import LLTokenizer

                eos = self._tokenizer.grammar_eos_token_id
                # n_vocab: the model's logits may have more rows than the tokenizer has tokens; those never pass
                self._ll_tokenizer = LLTokenizer(self._tokenizer.to_json(), n_vocab=self._vocab_size,
                                                 eos_token=eos)
            return self._ll_tokenizer


class Matcher:
    """One request's position in its grammar."""

    def __init__(self, matcher: Any) -> None:
        self._m = matcher

    def fill_mask(self, masks: np.ndarray, index: int) -> None:
        """Write the allowed next tokens into row `index` of `masks` [rows, words] (int32), one bit per token."""
        from llguidance.numpy import fill_next_token_bitmask

        fill_next_token_bitmask(self._m, masks, index)

    def accept(self, token_id: int) -> bool:
        """Follow a sampled token; False if the grammar rejects it (a token its mask allowed never is)."""
        return self._m.consume_token(token_id)

    @property
    def done(self) -> bool:
        """The grammar is complete and takes nothing more (but the end of the sequence)."""
        return self._m.is_stopped()


def mask_words(vocab_size: int) -> int:
    return (vocab_size + 31) // 32


def apply_masks(logits: torch.Tensor, rows: list[int], masks: torch.Tensor) -> None:
    """Set to -inf, in rows `rows` of `logits` [B, vocab], every token whose bit in `masks` [len(rows), words]
    (int32, on the host) is clear."""
    words = masks.to(logits.device, non_blocking=True)
    shifts = torch.arange(32, device=logits.device, dtype=torch.int32)
    allowed = ((words.unsqueeze(-1) >> shifts) & 1).bool().flatten(1)[:, :logits.shape[1]]
    index = torch.tensor(rows, device=logits.device)
    logits[index] = logits[index].masked_fill(~allowed, float("-inf"))
