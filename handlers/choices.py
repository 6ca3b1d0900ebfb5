"""The `n` choices of one request: n engine requests (choice i seeded seed + i), their first outputs awaited
before any byte is sent (a parameter the engine refuses is a 400), and their outputs merged in the order
they come. A single choice goes through untouched, at no cost.

The first choice is prefilled alone: once its prompt is in the KV cache, the other choices find it in the
prefix cache (runtime/engine/block_manager.py) and compute only the prompt's last, partial block, so the
prompt is prefilled once, at the cost of one step's wait for choices 1 to n-1.
"""

from __future__ import annotations

import asyncio
from typing import AsyncIterator

from handlers.openai_protocol import GenerationRequest
from runtime.engine.outputs import RequestOutput
from runtime.engine.sampling_params import InvalidParams
from runtime.server.engine_view import EngineView
from runtime.server.errors import bad_request

Outputs = AsyncIterator[RequestOutput]


async def start(engine: EngineView, req: GenerationRequest) -> tuple[list[RequestOutput], list[Outputs]]:
    """Every choice's engine stream and its first output."""
    streams = [engine.generate(req.prompt, req.choice_params(i), req.request_id(i)) for i in range(req.n)]
    firsts: list = []
    for group in (streams[:1], streams[1:]):
        firsts += await asyncio.gather(*(anext(s) for s in group), return_exceptions=True)
        failed = [f for f in firsts if isinstance(f, BaseException)]
        if failed:
            await close(streams)
            if isinstance(failed[0], InvalidParams):  # prompt too long, or a parameter the engine refuses
                raise bad_request(str(failed[0]), failed[0].param) from None
            raise failed[0]
    return firsts, streams


async def close(streams: list[Outputs]) -> None:
    """Closing an engine stream that has not finished aborts its request and frees its KV blocks."""
    await asyncio.gather(*(s.aclose() for s in streams), return_exceptions=True)


async def merged(firsts: list[RequestOutput], streams: list[Outputs]) -> AsyncIterator[tuple[int, RequestOutput]]:
    """(choice index, output) from every choice until each has finished; closing it early aborts them all."""
    race = _race(firsts, streams) if len(streams) > 1 else None
    try:
        if race is not None:
            async for item in race:
                yield item
        else:
            out = firsts[0]
            yield 0, out
            while not out.finished:
                out = await anext(streams[0])
                yield 0, out
    finally:
        if race is not None:
            await race.aclose()
        await close(streams)


async def _race(firsts: list[RequestOutput], streams: list[Outputs]) -> AsyncIterator[tuple[int, RequestOutput]]:
    pending: dict[asyncio.Future, int] = {}
    try:
        for i, out in enumerate(firsts):
            yield i, out
            if not out.finished:
                pending[asyncio.ensure_future(anext(streams[i]))] = i
        while pending:
            done, _ = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            for future in done:
                i = pending.pop(future)
                out = future.result()
                yield i, out
                if not out.finished:
                    pending[asyncio.ensure_future(anext(streams[i]))] = i
    finally:
        for future in pending:  # a stream is closed only once nothing waits on it
            future.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
