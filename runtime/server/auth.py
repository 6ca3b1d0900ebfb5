"""The optional API key: `Authorization: Bearer <API_KEY>` on the /v1 routes; /health and /metrics stay
open so that probes and scrapers need no secret."""

from __future__ import annotations

import hmac

from starlette.types import ASGIApp, Receive, Scope, Send

from runtime.server.errors import APIError


class APIKeyMiddleware:
    def __init__(self, app: ASGIApp, api_key: str, protected_prefix: str = "/v1") -> None:
        self.app = app
        self._expected = f"Bearer {api_key}".encode()
        self._prefix = protected_prefix

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["path"].startswith(self._prefix):
            given = dict(scope["headers"]).get(b"authorization", b"")
            # compare_digest: the time taken must not tell how much of a guessed key was right
            if not hmac.compare_digest(given, self._expected):
                message = ("Incorrect API key provided" if given
                           else "Missing API key: send 'Authorization: Bearer <key>'")
                error = APIError(401, message, code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})
                await error.response()(scope, receive, send)
                return
        await self.app(scope, receive, send)
