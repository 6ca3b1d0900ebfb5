"""Cancel work whose client has gone away, until a response starts (a streamed response watches for itself).

Uvicorn does not cancel a request's task when its client disconnects; an ASGI app has to watch for
`http.disconnect` itself. A request that nobody will read would otherwise keep its place in the queue, then
its sequence in the batch (and its KV blocks) until max_tokens.
"""

from __future__ import annotations

import asyncio
from typing import Awaitable, TypeVar

from starlette.requests import ClientDisconnect
from starlette.types import Receive

T = TypeVar("T")


async def unless_disconnected(receive: Receive, work: Awaitable[T]) -> T:
    """The result of `work`; raises ClientDisconnect (after cancelling `work`) if the client leaves first.
    Call it after the request body has been read, so that the next message can only be a disconnect."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_disconnected(receive))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        if not task.done():  # the client left, or we were cancelled ourselves
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
        watcher.cancel()
    if task.cancelled():
        raise ClientDisconnect()
    return task.result()


async def _disconnected(receive: Receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass
