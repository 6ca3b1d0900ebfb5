"""The one Starlette app: served by uvicorn on $PORT and called directly by the Lambda runtime loop."""

from __future__ import annotations

import asyncio
from typing import Sequence

import anyio
import anyio.lowlevel
from starlette.applications import Starlette
from starlette.middleware import Middleware

from runtime.server.auth import APIKeyMiddleware
from runtime.server.body_limit import BodyLimitMiddleware
from runtime.server.errors import EXCEPTION_HANDLERS
from runtime.server.handler import Handler
from runtime.server.state import AppState

DEFAULT_MAX_REQUEST_BYTES = 8 << 20  # MAX_REQUEST_MB's default


def build_app(state: AppState, handlers: Sequence[Handler], api_key: str | None = None,
              max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES) -> Starlette:
    """Routes of `handlers` in order (the first route to match a path wins, so the health handler goes
    first and a custom handler cannot shadow the probes), then /metrics."""
    routes = [route for handler in handlers for route in handler.build_routes(state)]
    routes.append(state.metrics.route())
    middleware = [Middleware(BodyLimitMiddleware, max_bytes=max_request_bytes)]
    if api_key:
        middleware.append(Middleware(APIKeyMiddleware, api_key=api_key))
    app = Starlette(routes=routes, middleware=middleware, exception_handlers=EXCEPTION_HANDLERS)
    app.state.thawllm = state
    load_async_backend()
    return app


def load_async_backend() -> None:
    """Starlette streams a response inside an anyio task group, and anyio imports its asyncio backend the
    first time one is made: 40 ms into the first streamed token of a process on this machine, 0.1 s on the
    H100 machine, unless it is loaded here (or in the snapshot, snapshots/frozen.py). A few ms once loaded.
    Inside a running event loop (an app built by async code) it cannot run one, and the first stream loads it."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        anyio.run(anyio.lowlevel.checkpoint)
