"""A bound on request bodies: a body larger than MAX_REQUEST_MB is answered 413 with an OpenAI error object,
whether its Content-Length says so up front or it only turns out while it is read. Without it a client can
make the server buffer, parse and tokenise any amount of text."""

from __future__ import annotations

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from runtime.server.errors import APIError


def too_large(limit: int) -> APIError:
    return APIError(413, f"The request body is larger than this server accepts ({limit} bytes, MAX_REQUEST_MB)",
                    code="request_too_large")


class BodyLimitMiddleware:
    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = dict(scope["headers"]).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_bytes:
            await too_large(self.max_bytes).response()(scope, receive, send)
            return
        received = 0

        async def receive_within_limit() -> Message:
            # Raised inside the route (where the body is read): the app's APIError handler answers it.
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_bytes:
                    raise too_large(self.max_bytes)
            return message

        await self.app(scope, receive_within_limit, send)
