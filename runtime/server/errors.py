"""The one error type of the HTTP room, and how every failure becomes an OpenAI error object.

Clients of an OpenAI-compatible server parse `{"error": {"message", "type", "param", "code"}}` whatever
went wrong, so malformed JSON, unknown routes, a missing key and a crash all answer in that shape.
"""

from __future__ import annotations

from typing import Mapping

import orjson
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import Response

from runtime.engine.outputs import RequestCut
from runtime.logs import get_logger

log = get_logger("server")

#: the `type` OpenAI's API gives each status
_TYPES = {400: "invalid_request_error", 401: "invalid_request_error", 404: "invalid_request_error",
          405: "invalid_request_error", 413: "invalid_request_error", 503: "service_unavailable_error"}


class APIError(Exception):
    """Answer the request with this status and an OpenAI error object."""

    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None,
                 type: str | None = None, headers: Mapping[str, str] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.type = type or _TYPES.get(status, "server_error")
        self.headers = dict(headers or {})

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self) -> Response:
        return Response(orjson.dumps(self.body()), self.status, self.headers, media_type="application/json")


def cut_by_shutdown(exc: RequestCut) -> APIError:
    """A request the shutdown's grace period ended: the client may retry elsewhere."""
    return APIError(503, f"the server shut down before the request finished: {exc}", code="shutting_down")


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, param=param, code=code)


def not_ready(reason: str) -> APIError:
    # Retry-After: a client (or a load balancer) should simply come back; the instance is warming up.
    return APIError(503, reason, code="not_ready", headers={"Retry-After": "1"})


async def api_error_handler(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, APIError)
    return exc.response()


async def http_exception_handler(request: Request, exc: Exception) -> Response:
    """Starlette's own 404 and 405 (no such route, wrong method), in OpenAI's shape."""
    assert isinstance(exc, HTTPException)
    if exc.status_code == 404:
        message = f"Unknown request URL: {request.method} {request.url.path}"
    elif exc.status_code == 405:
        message = f"Method {request.method} is not allowed on {request.url.path}"
    else:
        message = str(exc.detail)
    return APIError(exc.status_code, message, code="not_found" if exc.status_code == 404 else None,
                    headers=exc.headers).response()


async def request_cut_handler(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, RequestCut)
    return cut_by_shutdown(exc).response()


async def server_error_handler(request: Request, exc: Exception) -> Response:
    log.error("unhandled error in %s %s", request.method, request.url.path, exc_info=exc)
    return APIError(500, f"internal error: {type(exc).__name__}: {exc}", type="server_error").response()


EXCEPTION_HANDLERS = {APIError: api_error_handler, HTTPException: http_exception_handler,
                      RequestCut: request_cut_handler, Exception: server_error_handler}
