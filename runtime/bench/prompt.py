"""Prompts of a given length in the served model's tokens.

With the model's tokenizer.json at hand (a Hugging Face directory) prompts are token ids, exactly as long as
asked; otherwise (GGUF, s3://, the embedded model) they are text of about that length, and the server's
usage report gives the real count.
"""

from __future__ import annotations

import random
from pathlib import Path

from runtime.bench.client import Prompt

_TEXT = (
    "Serverless functions start on demand and stop when idle, so the first request after a quiet spell pays "
    "for the whole start: the runtime imports its libraries, builds the model, copies the weights from "
    "storage to the accelerator, sizes the key-value cache and records the kernels it will replay. Each of "
    "these steps can be measured on its own, and most of them do the same work every time, which is why a "
    "snapshot taken once at build time can stand in for them at start. The questions a user asks are short "
    "and varied: summarise this page, explain an error message, write a polite reply to a customer, turn a "
    "list of numbers into a table, suggest a name for a project about rivers and maps. ")
_WORDS_PER_TOKEN = 0.75  # English text in a BPE vocabulary, roughly


class PromptMaker:
    def __init__(self, model: str | None) -> None:
        self._ids = _text_token_ids(model)

    @property
    def exact(self) -> bool:
        """True when prompts are token ids of exactly the length asked."""
        return self._ids is not None

    def prompt(self, n_tokens: int, rng: random.Random | None = None) -> Prompt:
        """`n_tokens` of ordinary text; `rng` picks a different starting point each time, so that prompts
        of a trace do not share a prefix."""
        if self._ids is not None:
            start = rng.randrange(len(self._ids)) if rng else 0
            repeated = self._ids * (2 + n_tokens // len(self._ids))
            return repeated[start:start + n_tokens]
        words = _TEXT.split()
        start = rng.randrange(len(words)) if rng else 0
        count = max(1, round(n_tokens * _WORDS_PER_TOKEN))
        repeated = words * (2 + count // len(words))
        return " ".join(repeated[start:start + count])


def _text_token_ids(model: str | None) -> list[int] | None:
    if model is None or model.startswith("s3://"):
        return None
    path = Path(model).expanduser() / "tokenizer.json"
    if not path.is_file():
        return None
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(path)).encode(_TEXT, add_special_tokens=False).ids
