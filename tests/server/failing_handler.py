"""A handler for the Lambda tests: the OpenAI routes plus one route that fails after it began streaming."""

from __future__ import annotations

from starlette.requests import Request
from starlette.responses import StreamingResponse
from starlette.routing import Route

from handlers import openai
from runtime.server.handler import Handler
from runtime.server.state import AppState


def routes(state: AppState) -> list[Route]:
    async def fail_midway(request: Request) -> StreamingResponse:
        async def body():
            yield b"data: first\n\n"
            raise RuntimeError("disk on fire")

        return StreamingResponse(body(), media_type="text/event-stream")

    return [Route("/fail-midway", fail_midway, methods=["GET"]), *openai.routes(state)]


handler = Handler(routes=routes, name="failing")
