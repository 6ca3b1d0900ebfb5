"""The engine as handlers see it: generate(), abort(), the tokenizer and stats(), nothing else.

Every token a handler streams passes through here, so time to first token, inter-token latency and token
counts are measured once for every handler, the shipped ones and custom ones alike.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, AsyncIterator, Protocol

from runtime import timeline as stages
from runtime.engine.outputs import EngineStats, RequestOutput
from runtime.engine.sampling_params import SamplingParams
from runtime.timeline import Timeline

if TYPE_CHECKING:
    from runtime.engine import Engine
    from runtime.engine.tokenizer import Tokenizer
    from runtime.server.metrics import ServerMetrics


class Gate(Protocol):
    """What a request passes before and after the engine: several models share one device's memory, and a
    request's model is made resident (and kept so) through its device's pool (runtime/server/switching.py)."""

    async def enter(self) -> None: ...

    def leave(self, seconds: float) -> None: ...


class EngineView:
    def __init__(self, engine: "Engine", metrics: "ServerMetrics", timeline: Timeline,
                 gate: Gate | None = None) -> None:
        self._engine = engine
        self._metrics = metrics
        self._timeline = timeline
        self._gate = gate
        self._label = engine.model_name if gate is not None else None  # several models: each its own series
        self._served_first_token = False

    @property
    def engine(self) -> "Engine":
        return self._engine

    @property
    def model_name(self) -> str:
        return self._engine.model_name

    @property
    def max_model_len(self) -> int:
        return self._engine.max_model_len

    @property
    def tokenizer(self) -> "Tokenizer":
        return self._engine.tokenizer

    def stats(self) -> EngineStats:
        return self._engine.stats()

    async def abort(self, request_id: str) -> None:
        await self._engine.abort(request_id)

    def cut_requests(self, reason: str) -> None:
        """End every request in flight with RequestCut(reason): the shutdown's grace period is over."""
        self._engine.cut_requests(reason)

    def generate(self, prompt: str | list[int], params: SamplingParams,
                 request_id: str | None = None) -> AsyncIterator[RequestOutput]:
        """The engine's stream, measured. Raises InvalidParams before the first output. Closing this
        generator early (the client went away) closes the engine's, which aborts the request."""
        started = time.perf_counter()
        if self._gate is None:
            return self._measured(prompt, params, request_id, started)
        return self._gated(self._gate, prompt, params, request_id, started)

    async def _gated(self, gate: Gate, prompt: str | list[int], params: SamplingParams, request_id: str | None,
                     started: float) -> AsyncIterator[RequestOutput]:
        await gate.enter()  # time to first token includes the switch to the request's model
        entered = time.perf_counter()
        stream = self._measured(prompt, params, request_id, started)
        try:
            async for out in stream:
                yield out
        finally:
            await stream.aclose()
            gate.leave(time.perf_counter() - entered)

    async def _measured(self, prompt: str | list[int], params: SamplingParams, request_id: str | None,
                        started: float) -> AsyncIterator[RequestOutput]:
        metrics = self._metrics
        last = started
        first = True
        stream = self._engine.generate(prompt, params, request_id)
        try:
            async for out in stream:
                if out.token_ids:
                    now = time.perf_counter()
                    if first:
                        metrics.first_token(now - started, self._label)
                        self._first_token_of_process()
                    metrics.tokens(len(out.token_ids), None if first else now - last, self._label)
                    first = False
                    last = now
                if out.finished:
                    metrics.finished(out.finish_reason, out.prompt_tokens, time.perf_counter() - started,
                                     self._label)
                yield out
        finally:
            await stream.aclose()

    def _first_token_of_process(self) -> None:
        # The cold start ends with the first token the instance serves, not with "ready".
        if not self._served_first_token:
            self._served_first_token = True
            self._timeline.mark(stages.FIRST_TOKEN)
