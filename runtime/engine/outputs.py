"""What the engine hands back to a handler, one record per step of a request."""

from __future__ import annotations

from dataclasses import dataclass, field


class RequestCut(RuntimeError):
    """The request was ended before it finished because the server stops (its shutdown grace period ran out):
    raised by `generate()` in place of the next output."""


@dataclass
class TokenLogprob:
    token_id: int
    token: str
    # None: the token was put in, not sampled (a grammar's closing, runtime/engine/grammar.py)
    logprob: float | None
    # the most likely tokens at this step, as (token_id, token text, logprob), when asked for
    top: list[tuple[int, str, float]] = field(default_factory=list)
    # the token's own bytes (`token` cannot hold a part of a UTF-8 character), and those of each of `top`
    bytes: bytes = b""
    top_bytes: list[bytes] = field(default_factory=list)


@dataclass
class RequestOutput:
    """New text and tokens since the previous output of the same request.

    `text` never ends in the middle of a UTF-8 character and never contains text that might still turn
    out to be the start of a stop string; both are held back until resolved.
    """

    request_id: str
    text: str
    token_ids: list[int]
    logprobs: list[TokenLogprob] | None
    finished: bool
    finish_reason: str | None  # "stop", "length" or "abort" once finished
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int = 0     # prompt tokens whose keys and values came from the prefix cache


@dataclass
class EngineStats:
    running: int
    waiting: int
    kv_blocks_used: int
    kv_blocks_total: int
    steps: int = 0              # steps launched since start
    steps_run_ahead: int = 0    # of which launched before the previous step's tokens were read
    prefix_cache_queries: int = 0   # tokens looked up in the prefix cache
    prefix_cache_hits: int = 0      # of which found there
