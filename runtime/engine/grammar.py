"""Grammar-constrained decoding through llguidance: a request's grammar (a JSON schema or a Lark grammar)
becomes a matcher that says, before each token, which tokens may come next, and follows the tokens chosen.

llguidance is imported on the first request that uses a grammar, never on the start path. A grammar is
compiled once per distinct source and kept (least recently used first out), with the shortest plan found
from its start (runtime/engine/closing.py); each request gets a copy of the compiled matcher, which costs
microseconds.

A matcher also keeps the output closable within its token budget: it carries a plan, tokens that would
complete the grammar from where the output is, and keeps it no longer than the tokens left. Each step it
checks that the plan still completes the grammar after the token chosen (one call that consumes nothing:
about 10 us for a 26-token plan, where the mask takes 20 to 80 us on a 49k-token vocabulary), and walks
to a new one only when that token broke it (opened or closed what the plan did not). The check cannot
wait until the budget is near: one token may open more than any bound known in advance (a `{` of an
object with many required fields), so a plan left unchecked could turn out longer than the tokens left;
the check is what keeps the invariant (plan <= tokens left) true at every step. Once fewer than
`NEAR` tokens are left to spare over the plan, the mask allows only the closing tokens after which a plan
still fits; a token chosen from the full mask that leaves no plan within the budget (one that opens more
than the spare tokens can close) is replaced by the plan's first token. The output then ends complete, and
`steered` says the budget, not the model, ended it.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from runtime.engine.closing import MAX_PLAN, ClosingTokens, candidates, greedy_plan, shortest_plan
from runtime.engine.sampling_params import GrammarSpec, InvalidParams

if TYPE_CHECKING:
    from runtime.engine.tokenizer import Tokenizer

#: compiled grammars kept; a compiled JSON schema is tens of kilobytes
CACHE_SIZE = 256
#: JSON as Python's json.dumps writes it: ", " and ": ", and no other whitespace. Free whitespace lets a
#: weak model fill max_tokens with spaces and newlines before the first key.
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
#: spare tokens over the plan below which only closing tokens are allowed: a few, so that the model itself
#: closes what it has open before the substitution (its last resort) has to
NEAR = 4
#: plan tokens a sampled token may stand for at once (a '"}]' for '"', '}' and ']')
MERGED = 3


class GrammarCompiler:
    """Compiles grammars for one tokenizer and hands out matchers (thread-safe: the server compiles, the
    engine thread matches)."""

    def __init__(self, tokenizer: "Tokenizer", vocab_size: int) -> None:
        self._tokenizer = tokenizer
        self._vocab_size = vocab_size
        self._ll_tokenizer: Any = None
        self._closing: ClosingTokens | None = None
        self._compiled: OrderedDict[GrammarSpec, tuple[Any, list[int] | None]] = OrderedDict()
        self._lock = threading.Lock()

    def matcher(self, spec: GrammarSpec) -> "Matcher":
        """A fresh matcher for `spec`; raises InvalidParams (naming spec.param) when the grammar is invalid."""
        with self._lock:
            compiled = self._compiled.get(spec)
            if compiled is not None:
                self._compiled.move_to_end(spec)
        if compiled is None:
            matcher = self._compile(spec)
            compiled = matcher, shortest_plan(matcher.deep_copy(), self._closing_tokens())
            with self._lock:
                self._compiled[spec] = compiled
                while len(self._compiled) > CACHE_SIZE:
                    self._compiled.popitem(last=False)
        matcher, plan = compiled
        return Matcher(matcher.deep_copy(), self._closing_tokens(), plan)

    def _closing_tokens(self) -> ClosingTokens:
        tokenizer = self._llg_tokenizer()
        with self._lock:
            if self._closing is None:
                self._closing = ClosingTokens.of(tokenizer, self._vocab_size, self._tokenizer.grammar_eos_token_id)
            return self._closing

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
    """One request's position in its grammar, and a plan to complete it within the tokens left."""

    def __init__(self, matcher: Any, closing: ClosingTokens, plan: list[int] | None) -> None:
        self._m = matcher
        self._closing = closing
        self.plan = plan  # None: no plan was found (the budget cannot be kept: the output may end cut)
        self.steered = False
        self._followed: dict[int, tuple[Any, list[int]]] = {}  # the closing tokens the last mask allowed

    @property
    def shortest(self) -> int | None:
        """Tokens in the shortest output found from here (None: none found)."""
        return len(self.plan) if self.plan is not None else None

    def fill_mask(self, masks: np.ndarray, index: int, left: int) -> None:
        """Write the allowed next tokens into row `index` of `masks` [rows, words] (int32), one bit per token,
        `left` tokens being left to the output (this one included)."""
        from llguidance.numpy import fill_next_token_bitmask

        self._followed = {}
        if self.plan is None or left - len(self.plan) >= NEAR:
            fill_next_token_bitmask(self._m, masks, index)
            return
        self.steered = True
        masks[index] = 0
        bits = masks.view(np.uint32)
        for token in dict.fromkeys(self.plan[:1] + candidates(self._m, self._closing)):
            followed = self._follow(token, left - 1, search=False)
            if followed is not None and _fits(followed[1], left - 1):
                self._followed[token] = followed
                bits[index, token >> 5] |= np.uint32(1 << (token & 31))
        if not self._followed:  # nothing closes (no end-of-sequence token to end an accepting output with)
            fill_next_token_bitmask(self._m, masks, index)

    def accept(self, token_id: int, left: int) -> int | None:
        """Follow a sampled token, `left` tokens being left to the output after it. Returns the token taken:
        the plan's first one where `token_id` leaves no way to finish within `left`; None if the grammar
        rejects it (a token its mask allowed never is)."""
        if self.plan is None:
            return token_id if self._m.consume_token(token_id) else None
        followed = self._followed.pop(token_id, None) or self._follow(token_id, left)
        self._followed = {}
        if followed is None:
            return None
        substitute = self.plan[0] if self.plan else self._closing.eos
        if not _fits(followed[1], left) and substitute is not None:
            self.steered = True
            token_id, followed = substitute, self._follow(substitute, left, search=False)
        self._m, self.plan = followed
        return token_id

    def _follow(self, token_id: int, left: int, search: bool = True) -> tuple[Any, list[int] | None] | None:
        """The state after `token_id` and a plan from there (None: none found); None if the grammar rejects
        the token. The plan is the current one's rest, or the current one where the token left it valid, else
        a greedy walk's; with `search`, the shortest found where that might not fit `left`. (The closing
        tokens a restricted mask weighs are not searched from: each would cost a search, and the plan's own
        next token always fits.)"""
        after = self._m.deep_copy()
        if not after.consume_token(token_id):
            return None
        plan = self.plan
        if plan and token_id == plan[0]:
            return after, plan[1:]
        # still valid after text inside a string or a digit; after a token that merges the plan's first few
        # (a '",' for '"' and ','), its rest is
        rest = next((plan[k:] for k in range(min(len(plan), MERGED) + 1) if self._completes(after, plan[k:])), None)
        plan = rest if rest is not None else greedy_plan(after.deep_copy(), self._closing)
        if search and not _fits(plan, left - NEAR):
            shorter = shortest_plan(after, self._closing, len(plan) - 1 if plan is not None else MAX_PLAN)
            plan = shorter if shorter is not None else plan
        return after, plan

    def _completes(self, matcher: Any, plan: list[int]) -> bool:
        """Whether `plan` completes the grammar from `matcher`'s state: the end-of-sequence token passes after
        it only where the grammar accepts (checked without consuming: a tenth of the cost)."""
        eos = self._closing.eos
        if eos is not None:
            return matcher.validate_tokens([*plan, eos]) == len(plan) + 1
        probe = matcher.deep_copy()
        return probe.consume_tokens(plan) and probe.is_accepting()

    @property
    def done(self) -> bool:
        """The grammar is complete and takes nothing more (but the end of the sequence)."""
        return self._m.is_stopped()


def _fits(plan: list[int] | None, left: int) -> bool:
    return plan is not None and len(plan) <= left


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
