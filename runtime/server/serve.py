"""Serving over HTTP with uvicorn, Knative's way: listen at once, become ready when the engine is, and on
SIGTERM refuse new requests, let the ones in flight finish (up to SHUTDOWN_GRACE_S), then exit 0."""

from __future__ import annotations

import asyncio
import signal
import sys
import threading
from types import FrameType
from typing import Any, Callable, TypeVar

import uvicorn
from starlette.types import ASGIApp

from runtime.config import ConfigError, Settings
from runtime.logs import get_logger
from runtime.server.state import AppState, StartedEngine

log = get_logger("server")
T = TypeVar("T")

#: chooses and runs a start path (blocking; called on a worker thread)
StartEngine = Callable[[], StartedEngine]


class _Server(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, state: AppState) -> None:
        super().__init__(config)
        self.state = state
        self.failed_status = 1  # the exit status if the engine does not start: 2 for a bad setting

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        # Health turns 503 and requests on kept-alive connections are refused; uvicorn closes the listener
        # and waits for the responses in flight.
        log.info("signal %d: draining (grace %.0f s)", sig, self.config.timeout_graceful_shutdown or 0)
        self.state.begin_drain()
        super().handle_exit(sig, frame)


def serve_http(app: ASGIApp, state: AppState, settings: Settings, start_engine: StartEngine) -> int:
    config = uvicorn.Config(
        app, host=settings.host, port=settings.port, lifespan="off", log_config=None,
        access_log=settings.log_level == "debug", timeout_graceful_shutdown=settings.shutdown_grace_s,
        # SSE streams of a slow generation must not be cut by a keep-alive timer between requests
        timeout_keep_alive=30)
    server = _Server(config, state)
    # uvicorn re-raises the signal it drained on once it is done, to get the default behaviour; for
    # SIGTERM that would end the process with 143 instead of the 0 Knative expects after a clean drain.
    signal.signal(signal.SIGTERM, lambda sig, frame: None)
    return asyncio.run(_serve(server, state, start_engine))


async def _serve(server: _Server, state: AppState, start_engine: StartEngine) -> int:
    starting = asyncio.create_task(_start(server, state, start_engine))
    await server.serve()
    if starting.done() and starting.result() is not None:
        starting.result().shutdown()
    else:  # SIGTERM while the engine was still starting: its daemon thread dies with the process
        starting.cancel()
    return server.failed_status if state.phase == "failed" else 0


async def _start(server: _Server, state: AppState, start_engine: StartEngine) -> Any:
    """Runs the start path off the event loop, so that /health answers 503 meanwhile; returns the engine."""
    try:
        started = await _in_daemon_thread(start_engine)
    except ConfigError as exc:  # a setting only the model could check (MAX_MODEL_LEN): one line, exit 2
        print(f"faas-bootstrap: {exc}", file=sys.stderr, flush=True)
        state.mark_failed(str(exc))
        server.failed_status = 2
        server.should_exit = True
        return None
    except Exception as exc:
        log.exception("the engine failed to start")
        state.mark_failed(f"{type(exc).__name__}: {exc}")
        # Exit rather than linger unready: the platform restarts the container and shows the crash.
        server.should_exit = True
        return None
    state.mark_ready(started)
    log.info("ready: serving %s on port %d (restore path %s)\n%s", state.model_name, server.config.port,
             started.restore_path, state.timeline.format_table())
    return started.engine


def _in_daemon_thread(fn: Callable[[], T]) -> "asyncio.Future[T]":
    # Not asyncio.to_thread: its executor is joined at exit, and a SIGTERM during a minute-long start
    # must not wait for the start to finish.
    loop = asyncio.get_running_loop()
    future: asyncio.Future[T] = loop.create_future()

    def settle(result: T | None, error: BaseException | None) -> None:
        if future.done():
            return
        if error is not None:
            future.set_exception(error)
        else:
            future.set_result(result)

    def run() -> None:
        try:
            result, error = fn(), None
        except BaseException as exc:  # handed to the awaiting task, which decides
            result, error = None, exc
        try:
            loop.call_soon_threadsafe(settle, result, error)
        except RuntimeError:  # the loop has closed: the server exited while we were starting
            pass

    threading.Thread(target=run, name="engine-start", daemon=True).start()
    return future
