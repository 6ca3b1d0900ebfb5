"""The handler framework: what HANDLER=module:attribute names, and how it is loaded.

A handler contributes HTTP routes (Starlette Route objects, served by uvicorn and behind Lambda Function
URLs alike) and/or an event function for Lambda invocations that are not HTTP requests (direct Invoke,
queues). It is given the AppState and reaches the engine only through `state.require_engine()`, an
EngineView: generate(), abort(), tokenizer, stats().

Anything with `routes` and/or `event` attributes works: a `Handler`, another object, or a module.
"""

from __future__ import annotations

import importlib
import os
import sys
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Awaitable, Callable, Sequence

from starlette.routing import BaseRoute

from runtime.config import ConfigError

if TYPE_CHECKING:
    from runtime.server.state import AppState


@dataclass(frozen=True)
class LambdaContext:
    """What the Runtime API says about one invocation (the subset of Python's Lambda context that a
    custom runtime can know)."""

    aws_request_id: str
    deadline_ms: int
    invoked_function_arn: str
    trace_id: str | None = None

    def get_remaining_time_in_millis(self) -> int:
        return max(0, self.deadline_ms - int(time.time() * 1000))


Routes = Callable[["AppState"], Sequence[BaseRoute]]
#: (event payload, invocation context, app state) -> a JSON-serialisable result
EventFunction = Callable[[Any, LambdaContext, "AppState"], Awaitable[Any]]


@dataclass(frozen=True)
class Handler:
    routes: Routes | None = None
    event: EventFunction | None = None
    name: str = "handler"

    def build_routes(self, state: "AppState") -> list[BaseRoute]:
        return list(self.routes(state)) if self.routes is not None else []


def load_handler(spec: str) -> Handler:
    """`module:attribute` (or a bare `module`) -> Handler. Raises ConfigError with a one-line reason.
    The working directory is searched first, as uvicorn does for its app, so that a handler file next to
    the function's code is found without packaging it."""
    module_name, _, attribute = spec.partition(":")
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        target: Any = importlib.import_module(module_name)
    except ImportError as exc:
        raise ConfigError(f"HANDLER={spec!r}: cannot import {module_name!r} ({exc})") from None
    for part in filter(None, attribute.split(".")):
        try:
            target = getattr(target, part)
        except AttributeError:
            raise ConfigError(f"HANDLER={spec!r}: {module_name!r} has no attribute {attribute!r}") from None
    if isinstance(target, Handler):
        return target
    routes, event = getattr(target, "routes", None), getattr(target, "event", None)
    if not callable(routes) and not callable(event):
        raise ConfigError(f"HANDLER={spec!r}: needs a routes(state) or event(payload, context, state) function")
    return Handler(routes if callable(routes) else None, event if callable(event) else None, name=spec)
