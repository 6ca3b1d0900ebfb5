"""Lambda HTTP events through the ASGI app: a Function URL / API Gateway HTTP API (payload format 2.0)
event becomes an ASGI request, and the app's response becomes either the buffered result object or a
streamed body behind the metadata prelude that Function URLs in RESPONSE_STREAM mode expect."""

from __future__ import annotations

import asyncio
import base64
from dataclasses import dataclass, field
from typing import Any, Awaitable, Callable
from urllib.parse import unquote

import orjson
from starlette.types import ASGIApp, Message

#: Function URL streaming: the body starts with a JSON prelude (status, headers, cookies) and 8 NUL bytes
HTTP_STREAM_CONTENT_TYPE = "application/vnd.awslambda.http-integration-response"
PRELUDE_DELIMITER = b"\0" * 8

_TEXT_TYPES = ("text/", "application/json", "application/javascript", "application/xml",
               "application/x-www-form-urlencoded")


def is_http_event(event: Any) -> bool:
    return (isinstance(event, dict) and event.get("version") == "2.0"
            and isinstance(event.get("requestContext"), dict) and "http" in event["requestContext"])


def asgi_request(event: dict[str, Any]) -> tuple[dict[str, Any], bytes]:
    """The ASGI scope and body of a payload 2.0 event."""
    http = event["requestContext"]["http"]
    headers = [(k.lower().encode(), str(v).encode()) for k, v in (event.get("headers") or {}).items()]
    if event.get("cookies"):  # payload 2.0 moves Cookie headers into their own list
        headers.append((b"cookie", "; ".join(event["cookies"]).encode()))
    raw_body = event.get("body") or ""
    body = base64.b64decode(raw_body) if event.get("isBase64Encoded") else raw_body.encode()
    raw_path = event.get("rawPath") or http.get("path") or "/"
    host = (event.get("headers") or {}).get("host", "lambda")
    scope = {
        "type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"}, "http_version": "1.1",
        "method": http.get("method", "GET").upper(), "scheme": "https",
        "path": unquote(raw_path), "raw_path": raw_path.encode(), "root_path": "",
        "query_string": (event.get("rawQueryString") or "").encode(), "headers": headers,
        "client": (http.get("sourceIp") or "0.0.0.0", 0), "server": (host, 443),
    }
    return scope, body


@dataclass
class ResponseHead:
    status: int
    headers: dict[str, str] = field(default_factory=dict)
    cookies: list[str] = field(default_factory=list)

    @classmethod
    def from_asgi(cls, message: Message) -> "ResponseHead":
        head = cls(message["status"])
        for raw_name, raw_value in message.get("headers", []):
            name, value = raw_name.decode().lower(), raw_value.decode()
            if name == "set-cookie":
                head.cookies.append(value)
            else:  # payload 2.0 has one value per header: repeated headers are comma-joined
                head.headers[name] = f"{head.headers[name]},{value}" if name in head.headers else value
        return head

    def prelude(self) -> bytes:
        return orjson.dumps({"statusCode": self.status, "headers": self.headers, "cookies": self.cookies}) \
            + PRELUDE_DELIMITER


class AppCallError(Exception):
    """The app failed before its response was complete. `started`: part of the response went out."""

    def __init__(self, message: str, started: bool) -> None:
        super().__init__(message)
        self.started = started


async def call_app(app: ASGIApp, event: dict[str, Any], on_head: Callable[[ResponseHead], Awaitable[None]],
                   on_body: Callable[[bytes], Awaitable[None]], disconnected: asyncio.Event) -> None:
    """Run one request through the app. `disconnected`, set by the caller when its stream broke, tells the
    app that the client is gone (which aborts the generation). An exception after the response completed
    (Starlette answers 500 and then re-raises) leaves the response standing; before, it is an AppCallError."""
    scope, body = asgi_request(event)
    sent_request = started = completed = False

    async def receive() -> Message:
        nonlocal sent_request
        if not sent_request:
            sent_request = True
            return {"type": "http.request", "body": body, "more_body": False}
        await disconnected.wait()
        return {"type": "http.disconnect"}

    async def send(message: Message) -> None:
        nonlocal started, completed
        if message["type"] == "http.response.start":
            started = True
            await on_head(ResponseHead.from_asgi(message))
        elif message["type"] == "http.response.body":
            if message.get("body"):
                await on_body(message["body"])
            completed = not message.get("more_body", False)

    try:
        await app(scope, receive, send)
    except Exception as exc:
        if not completed:
            raise AppCallError(f"{type(exc).__name__}: {exc}", started) from exc
    if not completed and not disconnected.is_set():
        raise AppCallError("the app returned before completing its response", started)


async def buffered_response(app: ASGIApp, event: dict[str, Any]) -> dict[str, Any]:
    """The app's whole response as the payload 2.0 result object."""
    head: ResponseHead | None = None
    chunks: list[bytes] = []

    async def on_head(h: ResponseHead) -> None:
        nonlocal head
        head = h

    async def on_body(chunk: bytes) -> None:
        chunks.append(chunk)

    await call_app(app, event, on_head, on_body, asyncio.Event())
    assert head is not None  # call_app raises unless the response completed
    body = b"".join(chunks)
    result: dict[str, Any] = {"statusCode": head.status, "headers": head.headers, "cookies": head.cookies}
    if _is_text(head.headers.get("content-type", "")):
        try:
            return result | {"body": body.decode(), "isBase64Encoded": False}
        except UnicodeDecodeError:
            pass
    return result | {"body": base64.b64encode(body).decode(), "isBase64Encoded": True}


def _is_text(content_type: str) -> bool:
    return content_type.startswith(_TEXT_TYPES) or "charset=" in content_type
