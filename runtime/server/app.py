"""The one Starlette app: served by uvicorn on $PORT and called directly by the Lambda runtime loop."""

from __future__ import annotations

from typing import Sequence

from starlette.applications import Starlette
from starlette.middleware import Middleware

from runtime.server.auth import APIKeyMiddleware
from runtime.server.errors import EXCEPTION_HANDLERS
from runtime.server.handler import Handler
from runtime.server.state import AppState


def build_app(state: AppState, handlers: Sequence[Handler], api_key: str | None = None) -> Starlette:
    """Routes of `handlers` in order (the first route to match a path wins, so the health handler goes
    first and a custom handler cannot shadow the probes), then /metrics."""
    routes = [route for handler in handlers for route in handler.build_routes(state)]
    routes.append(state.metrics.route())
    middleware = [Middleware(APIKeyMiddleware, api_key=api_key)] if api_key else []
    app = Starlette(routes=routes, middleware=middleware, exception_handlers=EXCEPTION_HANDLERS)
    app.state.thawllm = state
    return app
