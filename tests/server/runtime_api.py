"""A Lambda Runtime API on loopback, following AWS's documented protocol, for the Lambda tests.

https://docs.aws.amazon.com/lambda/latest/dg/runtimes-api.html and "Response streaming" in
runtimes-custom.html: `GET /2018-06-01/runtime/invocation/next` blocks until there is an event and
returns it with the Lambda-Runtime-* headers; `.../{id}/response` (202), buffered or, with
`Lambda-Runtime-Function-Response-Mode: streaming`, a chunked body whose trailers may carry an error;
`.../{id}/error` and `/runtime/init/error` (202) with Lambda-Runtime-Function-Error-Type. Unknown request
ids are 400, unknown paths 404. Real HTTP/1.1 over a socket (h11), so chunk boundaries and trailers are
observed exactly as the runtime sends them.
"""

from __future__ import annotations

import asyncio
import base64
import threading
import time
import uuid
from concurrent.futures import Future
from dataclasses import dataclass, field

import h11
import orjson

PREFIX = "/2018-06-01/runtime"


@dataclass
class Result:
    """What the runtime posted for one invocation."""

    kind: str                                   # "response" or "error"
    headers: dict[str, str]
    chunks: list[tuple[float, bytes]] = field(default_factory=list)  # (arrival time, data) per h11 Data event
    trailers: dict[str, str] = field(default_factory=dict)

    @property
    def body(self) -> bytes:
        return b"".join(data for _, data in self.chunks)

    def json(self):
        return orjson.loads(self.body)

    @property
    def streamed(self) -> bool:
        return self.headers.get("lambda-runtime-function-response-mode") == "streaming"

    def trailer_error(self) -> dict | None:
        body = self.trailers.get("lambda-runtime-function-error-body")
        return orjson.loads(base64.b64decode(body)) if body else None


class RuntimeAPIServer:
    def __init__(self) -> None:
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)
        self._events: asyncio.Queue | None = None
        self._pending: dict[str, Future] = {}
        self.init_errors: list[Result] = []
        self.init_error_posted = threading.Event()
        self.address = ""

    def __enter__(self) -> "RuntimeAPIServer":
        self._thread.start()
        asyncio.run_coroutine_threadsafe(self._listen(), self._loop).result(5)
        return self

    def __exit__(self, *exc) -> None:
        asyncio.run_coroutine_threadsafe(self._close(), self._loop).result(5)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(5)
        self._loop.close()

    async def _close(self) -> None:
        self._server.close()
        tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    async def _listen(self) -> None:
        self._events = asyncio.Queue()
        self._server = await asyncio.start_server(self._connection, "127.0.0.1", 0)
        host, port = self._server.sockets[0].getsockname()[:2]
        self.address = f"{host}:{port}"

    def invoke(self, event: dict | bytes, timeout: float = 60.0) -> Result:
        """Queue an invocation and wait for what the runtime posts for it."""
        request_id = str(uuid.uuid4())
        future: Future = Future()
        self._pending[request_id] = future
        payload = event if isinstance(event, bytes) else orjson.dumps(event)
        self._loop.call_soon_threadsafe(self._events.put_nowait, (request_id, payload))
        return future.result(timeout)

    # -- the protocol --------------------------------------------------------------------------------------

    async def _connection(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        conn = h11.Connection(h11.SERVER)
        try:
            while True:
                request, result = await self._read_request(conn, reader)
                if request is None:
                    return
                status, headers, body = await self._route(request, result)
                writer.write(conn.send(h11.Response(status_code=status, headers=[
                    ("Content-Type", "application/json"), ("Content-Length", str(len(body))), *headers])))
                writer.write(conn.send(h11.Data(data=body)) + conn.send(h11.EndOfMessage()))
                await writer.drain()
                if conn.our_state is h11.MUST_CLOSE or conn.their_state is h11.MUST_CLOSE:
                    return
                conn.start_next_cycle()
        except (ConnectionError, h11.RemoteProtocolError, asyncio.CancelledError):
            return
        finally:
            writer.close()

    async def _read_request(self, conn: h11.Connection, reader: asyncio.StreamReader):
        request, result = None, None
        while True:
            event = conn.next_event()
            if event is h11.NEED_DATA:
                data = await reader.read(65536)
                conn.receive_data(data)  # b"" tells h11 the peer closed
                continue
            if isinstance(event, h11.ConnectionClosed):
                return None, None
            if isinstance(event, h11.Request):
                request = event
                result = Result("", {k.decode().lower(): v.decode() for k, v in event.headers})
            elif isinstance(event, h11.Data):
                result.chunks.append((time.monotonic(), bytes(event.data)))
            elif isinstance(event, h11.EndOfMessage):
                result.trailers = {k.decode().lower(): v.decode() for k, v in event.headers}
                return request, result

    async def _route(self, request: h11.Request, result: Result) -> tuple[int, list, bytes]:
        method, path = request.method.decode(), request.target.decode()
        if method == "GET" and path == f"{PREFIX}/invocation/next":
            request_id, payload = await self._events.get()
            deadline = int((time.time() + 60) * 1000)
            return 200, [("Lambda-Runtime-Aws-Request-Id", request_id), ("Lambda-Runtime-Deadline-Ms", str(deadline)),
                         ("Lambda-Runtime-Invoked-Function-Arn", "arn:aws:lambda:us-east-1:123456789012:function:t"),
                         ("Lambda-Runtime-Trace-Id", "Root=1-5bef4de7-ad49b0e87f6ef6c87fc2e700;Sampled=1")], payload
        if method == "POST" and path == f"{PREFIX}/init/error":
            result.kind = "init_error"
            self.init_errors.append(result)
            self.init_error_posted.set()
            return 202, [], b'{"status":"OK"}'
        parts = path.removeprefix(f"{PREFIX}/invocation/").split("/")
        if method == "POST" and len(parts) == 2 and parts[1] in ("response", "error"):
            future = self._pending.pop(parts[0], None)
            if future is None:
                return 400, [], b'{"errorMessage":"unknown request id","errorType":"InvalidRequestID"}'
            if result.streamed and result.headers.get("transfer-encoding") != "chunked":
                return 400, [], b'{"errorMessage":"streaming needs a chunked body","errorType":"InvalidRequest"}'
            result.kind = parts[1]
            future.set_result(result)
            return 202, [], b'{"status":"OK"}'
        return 404, [], b'{"errorMessage":"not found"}'
