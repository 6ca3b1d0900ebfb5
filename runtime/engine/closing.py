"""Short ways to finish a grammar from where an output is: what lets a grammar-constrained output end as a
complete document when its token budget (`max_tokens`) runs out (runtime/engine/grammar.py).

A *plan* is a list of tokens that, consumed from a matcher's state, leaves it accepting. Plans are found by
a greedy walk that uses llguidance's cheap calls (checking a token takes about a microsecond, forced tokens
and `is_accepting` less; a full token mask takes tens to hundreds): at each state the
forced tokens if any, else the first of a short list of closing tokens the grammar takes, else the fewest
tokens of the masks past what must be written (an enum's letters, a regex's characters). `shortest_plan`
tries every closing token first and walks greedily from each, keeping the shortest walk.

A plan is not always the shortest possible one, but it is always a real path: it was consumed from the
state it starts at. That is what keeps the budget safe: while a plan fits the tokens left, the output can
still end complete. Bounding the search (a walk is cut as soon as it is longer than the best so far, or
than `MAX_PLAN`) never makes a plan invalid, only longer.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

#: plans longer than this are not looked for (a grammar this long to close has no budget worth keeping)
MAX_PLAN = 512
#: states the fallback looks through for the fewest tokens past what must be written (runtime cost: each
#: is a copy and a token, and each state it goes deeper from a mask)
FALLBACK_STATES = 256
#: the shortest JSON values first (the first one a state takes is the value a walk writes), each also after
#: the space that ends ": " and ", " (runtime/engine/grammar.py's JSON_OPTIONS), where tokenizers fold it in
_VALUES = ("0", "1", "2", "3", "4", "5", "6", "7", "8", "9", '""', "[]", "{}", "null", "true", "false",
           '"', "[", "{", "-")
#: between items: after the closers (a container that may end should) and before the values (a number
#: that may end should, rather than grow a digit at a time)
_SEPARATORS = (",", ", ")
_STARTERS = _SEPARATORS + tuple(p + v for v in _VALUES for p in ("", " "))


@dataclass(frozen=True)
class ClosingTokens:
    """A tokenizer's tokens that close things, found once per tokenizer."""

    closers: tuple[int, ...]        # made only of '}' and ']', longest first
    quote_closers: tuple[int, ...]  # a '"' followed only by '"', '}' and ']', longest first
    starters: tuple[int, ...]       # short values, shortest first (_STARTERS)
    brace: int | None               # '}' and ']' on their own: a state that takes both as text is in a string
    bracket: int | None
    eos: int | None
    lengths: dict[int, int]         # bytes of every token, for the fallback's longest-token choice

    @classmethod
    def of(cls, ll_tokenizer: Any, vocab_size: int, eos: int | None) -> "ClosingTokens":
        by_bytes: dict[bytes, int] = {}
        lengths = {}
        for token in range(vocab_size):
            raw = ll_tokenizer.decode_bytes([token])
            lengths[token] = len(raw)
            if raw and (raw in _STARTER_BYTES or not raw.strip(b'"}]')):
                by_bytes.setdefault(raw, token)
        longest_first = sorted(by_bytes, key=lambda raw: (-len(raw), raw))
        closers = tuple(by_bytes[r] for r in longest_first if not r.strip(b"}]"))
        quotes = tuple(by_bytes[r] for r in longest_first if r[:1] == b'"' and not r[1:].strip(b'"}]'))
        starters = tuple(by_bytes[s.encode()] for s in _STARTERS if s.encode() in by_bytes)
        return cls(closers, quotes, starters, by_bytes.get(b"}"), by_bytes.get(b"]"), eos, lengths)


_STARTER_BYTES = frozenset(s.encode() for s in _STARTERS)


def shortest_plan(matcher: Any, tokens: ClosingTokens, limit: int = MAX_PLAN) -> list[int] | None:
    """The shortest plan found from `matcher`'s state (not changed), at most `limit` tokens; None if none."""
    if matcher.is_accepting():
        return []
    best = None
    for first in candidates(matcher, tokens):
        after = matcher.deep_copy()
        if not after.consume_token(first):
            continue
        rest = greedy_plan(after, tokens, (len(best) - 2) if best is not None else limit - 1)
        if rest is not None:
            best = [first, *rest]
    return best


def candidates(matcher: Any, tokens: ClosingTokens) -> list[int]:
    """The first tokens a plan from here is looked for behind: the forced token, or every closing token and
    short value the state takes, and the greedy walk's own choice."""
    forced = matcher.compute_ff_tokens()
    if forced:
        return forced[:1]
    found = [t for t in _closing_order(matcher, tokens) if _takes(matcher, t)]
    if matcher.is_accepting() and tokens.eos is not None:
        found.append(tokens.eos)
    step = _greedy_step(matcher, tokens)
    if step and step[0] not in found:
        found.append(step[0])
    return found


def greedy_plan(matcher: Any, tokens: ClosingTokens, limit: int = MAX_PLAN) -> list[int] | None:
    """Walk greedily from `matcher`'s state (it is moved: pass a copy) until it accepts; None if that takes
    more than `limit` tokens or the walk gets stuck."""
    plan: list[int] = []
    while not matcher.is_accepting():
        step = _greedy_step(matcher, tokens)
        if not step or len(plan) + len(step) > limit or not matcher.consume_tokens(step):
            return None
        plan += step
    return plan


def _greedy_step(matcher: Any, tokens: ClosingTokens) -> list[int]:
    forced = matcher.compute_ff_tokens()
    if forced:
        return forced
    for token in _closing_order(matcher, tokens):
        if _takes(matcher, token):
            return [token]
    return _fallback_step(matcher, tokens)


def _closing_order(matcher: Any, tokens: ClosingTokens) -> tuple[int, ...]:
    """Inside a string (a state that takes both '}' and ']' as text) only a quote closes anything; else
    the closers, the separators and the short values, in that order."""
    in_text = (tokens.brace is not None and tokens.bracket is not None and _takes(matcher, tokens.brace)
               and _takes(matcher, tokens.bracket))
    return tokens.quote_closers if in_text else tokens.closers + tokens.starters


def _fallback_step(matcher: Any, tokens: ClosingTokens) -> list[int]:
    """No closing token fits (an enum's letters, a regex's characters): the fewest tokens, with the forced
    ones after them, that lead through the masks to a state that accepts, has forced tokens or takes a
    closer, looked for breadth first (longest tokens first) through at most FALLBACK_STATES states; else the
    mask's longest token (the fewest tokens for what must be written)."""
    allowed = _allowed(matcher, tokens)
    frontier: list[tuple[Any, list[int]]] = [(matcher, [])]
    looked = 0
    while frontier and looked < FALLBACK_STATES:
        deeper, settled = [], []
        for state, path in frontier:
            for token in (_allowed(state, tokens) if path else allowed)[:FALLBACK_STATES - looked]:
                looked += 1
                after = state.deep_copy()
                if not after.consume_token(token):
                    continue
                forced = after.compute_ff_tokens()
                if after.is_accepting() or forced or _takes_a_closer(after, tokens):
                    settled.append([*path, token, *forced])
                deeper.append((after, [*path, token]))
        if settled:
            return min(settled, key=len)
        frontier = deeper
    return allowed[:1]


def _allowed(matcher: Any, tokens: ClosingTokens) -> list[int]:
    """The mask's tokens, longest first (end-of-sequence left out: a plan ends where the grammar accepts)."""
    bits = np.unpackbits(np.frombuffer(matcher.compute_bitmask(), dtype=np.uint8), bitorder="little")
    allowed = [t for t in np.flatnonzero(bits).tolist() if t != tokens.eos]
    return sorted(allowed, key=lambda t: -tokens.lengths.get(t, 0))


def _takes_a_closer(matcher: Any, tokens: ClosingTokens) -> bool:
    return any(t is not None and _takes(matcher, t) for t in (tokens.brace, tokens.bracket))


def _takes(matcher: Any, token: int) -> bool:
    return matcher.validate_tokens([token]) == 1
