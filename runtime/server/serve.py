"""Serving over HTTP with uvicorn, Knative's way: listen at once, become ready when the engine is, and on
SIGTERM drain: keep listening, answer /health and new requests 503, let the requests in flight finish for up
to SHUTDOWN_GRACE_S, end those still running with an OpenAI error (a 503, or a final error event in a
stream), stop the engine's loop, exit 0."""

from __future__ import annotations

import asyncio
import logging
import os
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
#: after the grace period: how long requests ended by the drain have to send their error and close
CUT_WAIT_S = 2.0
#: threads that run the engine's native code; one still running when the interpreter finalises ends the
#: process with std::terminate (exit 134) instead of the status it meant to exit with
ENGINE_THREADS = ("engine-loop", "engine-start", "graphs-after-ready")


class _Server(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, state: AppState, grace_s: float) -> None:
        super().__init__(config)
        self.state = state
        self.grace_s = grace_s
        self.failed_status = 1  # the exit status if the engine does not start: 2 for a bad setting
        self._loop: asyncio.AbstractEventLoop | None = None
        self._draining = False

    async def startup(self, sockets: Any = None) -> None:
        self._loop = asyncio.get_running_loop()
        await super().startup(sockets)

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        # uvicorn's own exit closes the listener at once, so probes would be refused for the whole drain
        # rather than answered 503: the first signal drains here, and only then is uvicorn told to stop. A
        # second signal, or one before the engine serves (nothing to drain), stops at once.
        self.state.begin_drain()
        if self._draining or self._loop is None or self.state.engine is None:
            super().handle_exit(sig, frame)
            return
        self._draining = True
        log.info("signal %d: draining (grace %.0f s)", sig, self.grace_s)
        self._loop.call_soon_threadsafe(lambda: asyncio.ensure_future(self._drain()))

    async def _drain(self) -> None:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.grace_s
        while self._in_flight() and loop.time() < deadline:
            await asyncio.sleep(0.05)
        if self._in_flight():
            log.warning("grace period over: ending %d requests still in flight", self._in_flight())
            self.state.cut_requests(f"SHUTDOWN_GRACE_S={self.grace_s:g} ran out")
            deadline = loop.time() + CUT_WAIT_S
            while self._in_flight() and loop.time() < deadline:
                await asyncio.sleep(0.05)
        self.should_exit = True

    def _in_flight(self) -> int:
        return len(self.server_state.tasks)


def load_protocols() -> None:
    """uvicorn imports its HTTP protocol (h11 or httptools) and lifespan modules as its server starts, 15 ms
    on the CPU machine: a process snapshot has them loaded before it is frozen (snapshots/frozen.py)."""
    uvicorn.Config(_no_app, lifespan="off", log_config=None).load()


async def _no_app(scope: Any, receive: Any, send: Any) -> None:
    raise RuntimeError("load_protocols' placeholder app never serves")


def serve_http(app: ASGIApp, state: AppState, settings: Settings, start_engine: StartEngine) -> int:
    config = uvicorn.Config(
        app, host=settings.host, port=settings.port, lifespan="off", log_config=None,
        access_log=settings.log_level == "debug",
        # the drain (_Server._drain) has waited already: what is left is cut, given a moment to answer
        timeout_graceful_shutdown=CUT_WAIT_S,
        # SSE streams of a slow generation must not be cut by a keep-alive timer between requests
        timeout_keep_alive=30)
    server = _Server(config, state, settings.shutdown_grace_s)
    # uvicorn re-raises the signal it drained on once it is done, to get the default behaviour; for
    # SIGTERM that would end the process with 143 instead of the 0 Knative expects after a clean drain.
    signal.signal(signal.SIGTERM, lambda sig, frame: None)
    status = asyncio.run(_serve(server, state, start_engine))
    running = [t.name for t in threading.enumerate() if t.name in ENGINE_THREADS and t.is_alive()]
    if running:  # a start still under way, or a step that outlived the engine's stop
        log.warning("exiting while %s still runs", ", ".join(running))
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(status)
    return status


async def _serve(server: _Server, state: AppState, start_engine: StartEngine) -> int:
    # the start path's thread begins before uvicorn loads its config and binds: it does not wait for them
    starting = asyncio.create_task(_start(server, state, _in_daemon_thread(start_engine)))
    await server.serve()
    if starting.done() and starting.result() is not None:
        starting.result().shutdown()  # stops the engine's loop (requests were ended by the drain)
    else:  # SIGTERM while the engine was still starting: its daemon thread dies with the process
        starting.cancel()
    return server.failed_status if state.phase == "failed" else 0


async def _start(server: _Server, state: AppState, starting: "asyncio.Future[StartedEngine]") -> Any:
    """Waits for the start path, run off the event loop so that /health answers 503 meanwhile; returns the
    engine."""
    try:
        started = await starting
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
    log.info("ready: serving %s on port %d (restore path %s)\n%s", ", ".join(state.served_names),
             server.config.port, started.restore_path, state.timeline.format_table())
    return state.models if state.models is not None else started.engine


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
