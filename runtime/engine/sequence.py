"""One request's state as it moves through the scheduler: its tokens, its KV blocks, how far it got."""

from __future__ import annotations

import enum
import itertools
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from runtime.engine.sampling_params import SamplingParams

if TYPE_CHECKING:
    from runtime.engine.grammar import Matcher


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


_arrival = itertools.count()

#: an output token sampled on the device that the host has not read yet (async scheduling): the next step
#: takes its input from the device for it (runtime/engine/model_runner.py)
PENDING = -1


@dataclass(eq=False)
class Sequence:
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    output_ids: list[int] = field(default_factory=list)
    status: Status = Status.WAITING
    block_table: list[int] = field(default_factory=list)
    # tokens whose keys and values are already in the KV cache
    num_computed_tokens: int = 0
    # prompt tokens found in the prefix cache when the sequence was admitted (runtime/engine/block_manager.py)
    num_cached_tokens: int = 0
    # the prefix-cache keys of its first full blocks, each chained to the one before
    block_keys: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    arrival: int = field(default_factory=lambda: next(_arrival))
    # where the output is in the request's grammar (params.grammar), following the tokens the host has read
    grammar: "Matcher | None" = None

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def num_output_tokens(self) -> int:
        """Output tokens the host has read (PENDING ones at the end are not counted)."""
        n = len(self.output_ids)
        while n and self.output_ids[n - 1] == PENDING:
            n -= 1
        return n

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_ids)

    @property
    def last_token(self) -> int:
        return self.output_ids[-1] if self.output_ids else self.prompt_ids[-1]

    def token_ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    def tokens_between(self, start: int, end: int) -> list[int]:
        """token_ids()[start:end], without copying the whole sequence."""
        n = len(self.prompt_ids)
        if end <= n:
            return self.prompt_ids[start:end]
        return self.prompt_ids[start:] + self.output_ids[max(0, start - n):end - n]

    @property
    def num_uncomputed_tokens(self) -> int:
        return self.num_tokens - self.num_computed_tokens

    @property
    def finished(self) -> bool:
        return self.status is Status.FINISHED
