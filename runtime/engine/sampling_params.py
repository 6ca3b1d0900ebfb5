"""How one request wants its tokens chosen and when it wants to stop."""

from __future__ import annotations

from dataclasses import dataclass, field

#: OpenAI's bound on a logit_bias value
MAX_LOGIT_BIAS = 100.0


@dataclass(frozen=True)
class GrammarSpec:
    """A grammar the output must follow, enforced token by token (runtime/engine/grammar.py).

    `kind` is "json_schema" (`source` is the schema as JSON text), "regex", "lark" (a Lark grammar, as
    llguidance reads it) or "grammar" (Lark or llama.cpp's GBNF); `param` names the request parameter it
    came from, for errors."""

    kind: str
    source: str
    param: str = "response_format"


class InvalidParams(ValueError):
    """A sampling parameter is out of range. `param` names it (OpenAI's error objects carry it)."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param = param


@dataclass
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: off
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    min_p: float = 0.0
    # EOS and stop_token_ids are held back until this many tokens have been generated
    min_tokens: int = 0
    logit_bias: dict[int, float] = field(default_factory=dict)  # token id -> added to its logit
    grammar: GrammarSpec | None = None
    # None: no logprobs; 0: the chosen token's; k > 0: also the k most likely tokens at each step
    logprobs: int | None = None

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.validate()

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0 or self.top_k == 1

    def validate(self) -> None:
        def check(ok: bool, param: str, message: str) -> None:
            if not ok:
                raise InvalidParams(param, message)

        check(isinstance(self.max_tokens, int) and self.max_tokens >= 1, "max_tokens",
              f"max_tokens must be at least 1, got {self.max_tokens}")
        check(0.0 <= self.temperature <= 2.0, "temperature",
              f"temperature must be between 0 and 2, got {self.temperature}")
        check(0.0 < self.top_p <= 1.0, "top_p", f"top_p must be in (0, 1], got {self.top_p}")
        check(self.top_k == -1 or self.top_k >= 0, "top_k", f"top_k must be -1, 0 or positive, got {self.top_k}")
        check(-2.0 <= self.presence_penalty <= 2.0, "presence_penalty",
              f"presence_penalty must be between -2 and 2, got {self.presence_penalty}")
        check(-2.0 <= self.frequency_penalty <= 2.0, "frequency_penalty",
              f"frequency_penalty must be between -2 and 2, got {self.frequency_penalty}")
        check(0.0 < self.repetition_penalty <= 2.0, "repetition_penalty",
              f"repetition_penalty must be in (0, 2], got {self.repetition_penalty}")
        check(all(isinstance(s, str) and s for s in self.stop), "stop", "stop must be non-empty strings")
        check(len(self.stop) <= 16, "stop", "at most 16 stop strings")
        check(0.0 <= self.min_p <= 1.0, "min_p", f"min_p must be between 0 and 1, got {self.min_p}")
        check(isinstance(self.min_tokens, int) and 0 <= self.min_tokens <= self.max_tokens, "min_tokens",
              f"min_tokens must be between 0 and max_tokens ({self.max_tokens}), got {self.min_tokens}")
        check(all(isinstance(t, int) and t >= 0 for t in self.stop_token_ids), "stop_token_ids",
              "stop_token_ids must be non-negative token ids")
        check(all(isinstance(t, int) and t >= 0 and -MAX_LOGIT_BIAS <= b <= MAX_LOGIT_BIAS
                  for t, b in self.logit_bias.items()), "logit_bias",
              f"logit_bias maps token ids to values between -{MAX_LOGIT_BIAS:g} and {MAX_LOGIT_BIAS:g}")
        check(self.logprobs is None or 0 <= self.logprobs <= 20, "logprobs",
              f"top_logprobs must be between 0 and 20, got {self.logprobs}")
