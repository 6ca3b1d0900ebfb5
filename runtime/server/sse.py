"""Server-Sent Events: OpenAI's `data: <json>` framing and a response that always closes its stream.

The event iterator wraps an engine request. Starlette stops iterating when the client disconnects, but
it leaves closing the iterator to the garbage collector; here it is closed at once, so the engine aborts
the request and frees its KV blocks the moment the client is gone.
"""

from __future__ import annotations

from typing import Any, AsyncIterator

import orjson
from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

DONE = b"data: [DONE]\n\n"


def event(data: Any) -> bytes:
    return b"data: " + orjson.dumps(data) + b"\n\n"


class EventStreamResponse(StreamingResponse):
    media_type = "text/event-stream"

    def __init__(self, events: AsyncIterator[bytes], status_code: int = 200) -> None:
        # no-cache and no proxy buffering: every event should reach the client when it is produced
        super().__init__(events, status_code, headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self._events = events

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self._events.aclose()
