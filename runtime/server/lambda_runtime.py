"""AWS Lambda: a custom runtime that drives the same app through the Lambda Runtime API.

Why not a library: awslambdaric (AWS's Python runtime interface client) and Mangum (ASGI on Lambda) both
return buffered responses only; response streaming for Python exists only through the Lambda Web Adapter,
a separate Rust proxy in front of an HTTP server. The Runtime API is small and documented, so this module
speaks it directly, over h11 (the HTTP/1.1 state machine uvicorn already depends on), because streaming
needs what common HTTP clients lack: a chunked request body whose error is reported in trailers.

Protocol (https://docs.aws.amazon.com/lambda/latest/dg/runtimes-api.html):
  GET  /2018-06-01/runtime/invocation/next            long poll; the event, request id in headers
  POST /2018-06-01/runtime/invocation/{id}/response   the result; streamed with
       `Lambda-Runtime-Function-Response-Mode: streaming` and `Transfer-Encoding: chunked`, a mid-stream
       failure in the trailers Lambda-Runtime-Function-Error-Type / -Error-Body (base64 JSON)
  POST /2018-06-01/runtime/invocation/{id}/error      a failed invocation
  POST /2018-06-01/runtime/init/error                 a failed start; then the process exits
Errors carry `Lambda-Runtime-Function-Error-Type` and a body {errorMessage, errorType, stackTrace}.
"""

from __future__ import annotations

import asyncio
import base64
import os
import sys
import traceback
from dataclasses import dataclass, field
from typing import Any, Callable

import h11
import orjson
from starlette.types import ASGIApp

from runtime.config import ConfigError
from runtime.logs import get_logger
from runtime.server.handler import Handler, LambdaContext
from runtime.server.lambda_http import (
    HTTP_STREAM_CONTENT_TYPE,
    AppCallError,
    ResponseHead,
    buffered_response,
    call_app,
    is_http_event,
)
from runtime.server.state import AppState, StartedEngine

log = get_logger("lambda")

API = "/2018-06-01/runtime"
ERROR_TYPE = "Lambda-Runtime-Function-Error-Type"
ERROR_BODY = "Lambda-Runtime-Function-Error-Body"


class RuntimeAPIError(Exception):
    """The Runtime API answered with an unexpected status (or not at all)."""


@dataclass(frozen=True)
class LambdaError:
    error_type: str
    message: str
    stack_trace: list[str] = field(default_factory=list)

    @classmethod
    def from_exception(cls, exc: BaseException, error_type: str | None = None) -> "LambdaError":
        return cls(error_type or type(exc).__name__, str(exc) or type(exc).__name__,
                   traceback.format_exception(type(exc), exc, exc.__traceback__))

    def body(self) -> bytes:
        return orjson.dumps({"errorMessage": self.message, "errorType": self.error_type,
                             "stackTrace": self.stack_trace})


@dataclass(frozen=True)
class Invocation:
    request_id: str
    event: bytes
    context: LambdaContext


class _Connection:
    """One HTTP/1.1 exchange with the Runtime API (a fresh loopback connection each: simplest, and
    negligible next to an inference)."""

    def __init__(self, address: str) -> None:
        self.address = address
        self.host, _, port = address.rpartition(":")
        self.port = int(port)
        self.h11 = h11.Connection(h11.CLIENT)
        self.reader: asyncio.StreamReader | None = None
        self.writer: asyncio.StreamWriter | None = None

    async def open(self) -> None:
        self.reader, self.writer = await asyncio.open_connection(self.host, self.port)

    async def send(self, *events: h11.Event) -> None:
        assert self.writer is not None
        for ev in events:
            self.writer.write(self.h11.send(ev) or b"")
        await self.writer.drain()

    async def response(self) -> tuple[int, dict[str, str], bytes]:
        assert self.reader is not None
        status, headers, body = 0, {}, bytearray()
        while True:
            ev = self.h11.next_event()
            if ev is h11.NEED_DATA:
                data = await self.reader.read(65536)
                if not data:
                    raise RuntimeAPIError(f"the Runtime API at {self.address} closed the connection")
                self.h11.receive_data(data)
            elif isinstance(ev, h11.Response):
                status = ev.status_code
                headers = {k.decode().lower(): v.decode() for k, v in ev.headers}
            elif isinstance(ev, h11.Data):
                body += ev.data
            elif isinstance(ev, h11.EndOfMessage):
                return status, headers, bytes(body)

    async def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
            try:
                await self.writer.wait_closed()
            except OSError:
                pass

    def request(self, method: str, target: str, headers: list[tuple[str, str]]) -> h11.Request:
        return h11.Request(method=method, target=target, headers=[("Host", self.address), *headers])


class RuntimeAPI:
    def __init__(self, address: str) -> None:
        self.address = address

    async def _call(self, method: str, target: str, body: bytes = b"",
                    headers: list[tuple[str, str]] = ()) -> tuple[int, dict[str, str], bytes]:
        conn = _Connection(self.address)
        try:
            await conn.open()
            await conn.send(conn.request(method, target, [("Content-Length", str(len(body))), *headers]),
                            h11.Data(data=body), h11.EndOfMessage())
            return await conn.response()
        finally:
            await conn.close()

    async def next(self) -> Invocation:
        status, headers, body = await self._call("GET", f"{API}/invocation/next")
        if status != 200:
            raise RuntimeAPIError(f"GET /invocation/next: {status} {body[:200]!r}")
        request_id = headers["lambda-runtime-aws-request-id"]
        context = LambdaContext(request_id, int(headers.get("lambda-runtime-deadline-ms", "0")),
                                headers.get("lambda-runtime-invoked-function-arn", ""),
                                headers.get("lambda-runtime-trace-id"))
        return Invocation(request_id, body, context)

    async def respond(self, request_id: str, body: bytes) -> None:
        await self._expect_accepted("response", *await self._call(
            "POST", f"{API}/invocation/{request_id}/response", body, [("Content-Type", "application/json")]))

    async def fail(self, request_id: str, error: LambdaError) -> None:
        await self._expect_accepted("error", *await self._call(
            "POST", f"{API}/invocation/{request_id}/error", error.body(),
            [("Content-Type", "application/json"), (ERROR_TYPE, error.error_type)]))

    async def init_error(self, error: LambdaError) -> None:
        await self._expect_accepted("init/error", *await self._call(
            "POST", f"{API}/init/error", error.body(),
            [("Content-Type", "application/json"), (ERROR_TYPE, error.error_type)]))

    def stream(self, request_id: str, content_type: str) -> "ResponseStream":
        return ResponseStream(_Connection(self.address), request_id, content_type)

    @staticmethod
    async def _expect_accepted(what: str, status: int, headers: dict[str, str], body: bytes) -> None:
        if status != 202:
            # 413 (response too large) or 400/403: logged; the invocation is lost either way
            raise RuntimeAPIError(f"POST {what}: {status} {body[:200]!r}")


class ResponseStream:
    """A streamed invocation response: the request headers go out on the first write, each write is one
    chunk, and `close(error)` ends the body with the error trailers when the stream failed midway."""

    def __init__(self, conn: _Connection, request_id: str, content_type: str) -> None:
        self._conn = conn
        self._request_id = request_id
        self._content_type = content_type
        self._opened = False

    async def write(self, data: bytes) -> None:
        if not self._opened:
            await self._conn.open()
            await self._conn.send(self._conn.request("POST", f"{API}/invocation/{self._request_id}/response", [
                ("Content-Type", self._content_type), ("Lambda-Runtime-Function-Response-Mode", "streaming"),
                ("Transfer-Encoding", "chunked"), ("Trailer", f"{ERROR_TYPE}, {ERROR_BODY}")]))
            self._opened = True
        if data:
            await self._conn.send(h11.Data(data=data))

    async def close(self, error: LambdaError | None = None) -> None:
        try:
            await self.write(b"")
            trailers = [] if error is None else [
                (ERROR_TYPE, error.error_type), (ERROR_BODY, base64.b64encode(error.body()).decode())]
            await self._conn.send(h11.EndOfMessage(headers=trailers))
            await RuntimeAPI._expect_accepted("response (streaming)", *await self._conn.response())
        finally:
            await self._conn.close()

    async def abandon(self) -> None:
        await self._conn.close()


# -- the loop ----------------------------------------------------------------------------------------------

def run_lambda(address: str, app: ASGIApp, state: AppState, handler: Handler, invoke_mode: str,
               start_engine: Callable[[], StartedEngine]) -> int:
    """Init (start the engine, or report why not), then serve invocations until Lambda freezes or ends us."""
    return asyncio.run(_run(RuntimeAPI(address), app, state, handler, invoke_mode, start_engine))


def report_init_error(address: str, error: LambdaError) -> None:
    """For failures before the loop exists (bad settings). Best effort: the exit status says it too."""
    try:
        asyncio.run(RuntimeAPI(address).init_error(error))
    except (OSError, RuntimeAPIError) as exc:
        log.error("could not report the init error to the Runtime API: %s", exc)


async def _run(api: RuntimeAPI, app: ASGIApp, state: AppState, handler: Handler, invoke_mode: str,
               start_engine: Callable[[], StartedEngine]) -> int:
    try:
        started = await asyncio.to_thread(start_engine)
    except ConfigError as exc:  # a setting only the model could check: one line, exit 2
        print(f"faas-bootstrap: {exc}", file=sys.stderr, flush=True)
        state.mark_failed(str(exc))
        await api.init_error(LambdaError("Runtime.ConfigError", str(exc)))
        return 2
    except Exception as exc:
        log.exception("init failed")
        state.mark_failed(f"{type(exc).__name__}: {exc}")
        await api.init_error(LambdaError.from_exception(exc, "Runtime.InitError"))
        return 1
    state.mark_ready(started)
    log.info("ready on AWS Lambda (restore path %s, %s responses)\n%s", started.restore_path, invoke_mode,
             state.timeline.format_table())
    while True:
        invocation = await api.next()
        if invocation.context.trace_id:  # what the X-Ray SDK reads, per the custom runtime contract
            os.environ["_X_AMZN_TRACE_ID"] = invocation.context.trace_id
        try:
            await _invoke(api, app, state, handler, invoke_mode, invocation)
        except RuntimeAPIError as exc:
            log.error("%s: %s", invocation.request_id, exc)


async def _invoke(api: RuntimeAPI, app: ASGIApp, state: AppState, handler: Handler, invoke_mode: str,
                  invocation: Invocation) -> None:
    try:
        event = orjson.loads(invocation.event)
    except orjson.JSONDecodeError as exc:
        await api.fail(invocation.request_id, LambdaError.from_exception(exc, "Runtime.InvalidEvent"))
        return
    try:
        if not is_http_event(event):
            if handler.event is None:
                raise _Unsupported("this function answers HTTP events (Function URL, API Gateway HTTP API "
                                   f"payload 2.0); the handler {handler.name!r} has no event function")
            result = await handler.event(event, invocation.context, state)
            await api.respond(invocation.request_id, orjson.dumps(result))
        elif invoke_mode == "response_stream":
            await _stream_http(api, app, event, invocation.request_id)
        else:
            await api.respond(invocation.request_id, orjson.dumps(await buffered_response(app, event)))
    except RuntimeAPIError:
        raise
    except _Unsupported as exc:
        await api.fail(invocation.request_id, LambdaError.from_exception(exc, "Runtime.UnsupportedEvent"))
    except Exception as exc:
        log.exception("%s: invocation failed", invocation.request_id)
        await api.fail(invocation.request_id, LambdaError.from_exception(exc, "Runtime.HandlerError"))


class _Unsupported(Exception):
    pass


async def _stream_http(api: RuntimeAPI, app: ASGIApp, event: dict[str, Any], request_id: str) -> None:
    stream = api.stream(request_id, HTTP_STREAM_CONTENT_TYPE)
    disconnected = asyncio.Event()
    started = False

    async def on_head(head: ResponseHead) -> None:
        nonlocal started
        started = True
        await _write(head.prelude())

    async def _write(data: bytes) -> None:
        if disconnected.is_set():
            return
        try:
            await stream.write(data)
        except OSError as exc:  # the stream is gone: tell the app, which aborts the generation
            log.warning("%s: response stream broke: %s", request_id, exc)
            disconnected.set()

    try:
        await call_app(app, event, on_head, _write, disconnected)
    except AppCallError as exc:
        if not exc.started:
            raise  # nothing sent yet: an ordinary invocation error
        # Status and part of the body are out: the failure can only go into the trailers.
        log.error("%s: response failed midway: %s", request_id, exc)
        await stream.close(LambdaError.from_exception(exc, "Runtime.HandlerError"))
        return
    if disconnected.is_set():
        await stream.abandon()
    else:
        await stream.close()
