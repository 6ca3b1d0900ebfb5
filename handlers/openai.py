"""The default handler: OpenAI's /v1/chat/completions, /v1/completions and /v1/models.

A request is parsed (handlers/openai_protocol.py) on a worker thread, handed to the engine, and its first
output awaited before any byte is sent: the engine rejects a prompt that does not fit the context at that
point, and the client must get a 400, not a 200 stream that breaks. Then it is either streamed as
Server-Sent Events or collected into one JSON body. From the moment its body is read until its response
starts, a request is aborted as soon as its client disconnects.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any, AsyncIterator, Callable

import orjson
from starlette.requests import ClientDisconnect, Request
from starlette.responses import Response
from starlette.routing import Route

from handlers import choices
from handlers.openai_protocol import GenerationRequest, parse_chat, parse_completion, parse_json
from handlers.openai_responses import (
    ChoiceResult,
    chat_chunk,
    chat_response,
    completion_chunk,
    completion_logprobs,
    completion_response,
    tool_finish_reason,
    usage_chunk,
)
from handlers.tokenize import tokenize_routes
from handlers.tool_calls import ToolCallStream
from runtime.engine.outputs import RequestCut, RequestOutput
from runtime.logs import get_logger
from runtime.server.disconnect import unless_disconnected
from runtime.server.engine_view import EngineView
from runtime.server.errors import APIError, cut_by_shutdown
from runtime.server.handler import Handler
from runtime.server.sse import DONE, EventStreamResponse, event
from runtime.server.state import AppState

log = get_logger("openai")

Merged = AsyncIterator[tuple[int, RequestOutput]]


@dataclass(frozen=True)
class _Endpoint:
    """What differs between chat and plain completions: parsing, the stream's events, the JSON body."""

    parse: Callable[[dict[str, Any], EngineView, str], GenerationRequest]
    events: Callable[[GenerationRequest, Merged], AsyncIterator[bytes]]
    respond: Callable[[GenerationRequest, list[ChoiceResult]], dict[str, Any]]


def json_response(content: Any, status: int = 200) -> Response:
    return Response(orjson.dumps(content), status, media_type="application/json")


async def _generate(request: Request, state: AppState, endpoint: _Endpoint) -> Response:
    body = parse_json(await request.body())
    engine = state.require_engine(body.get("model"))
    try:
        # Watched from here on: a client that leaves while its prompt is rendered, queued or prefilled
        # gives its queue place and KV blocks back at once, not once its first token is out.
        return await unless_disconnected(request.receive, _answer(body, state, engine, endpoint))
    except ClientDisconnect:
        log.info("client disconnected, %s request aborted", request.url.path)
        return Response(status_code=499)  # nobody reads it; nginx's "client closed request"


async def _answer(body: dict[str, Any], state: AppState, engine: EngineView, endpoint: _Endpoint) -> Response:
    # Rendering the chat template and tokenising leave the event loop: a prompt of megabytes takes seconds,
    # and /health and every other request would wait for it.
    req = await asyncio.to_thread(endpoint.parse, body, engine, state.model_name or engine.model_name)
    firsts, streams = await choices.start(engine, req)
    outputs = choices.merged(firsts, streams)
    if req.stream:
        return EventStreamResponse(endpoint.events(req, outputs))
    return json_response(endpoint.respond(req, await _collect(req, outputs)))


async def _collect(req: GenerationRequest, outputs: Merged) -> list[ChoiceResult]:
    texts: list[list[str]] = [[] for _ in range(req.n)]
    logprobs: list[list] = [[] for _ in range(req.n)]
    lasts: dict[int, RequestOutput] = {}
    try:
        async for i, out in outputs:
            texts[i].append(out.text)
            logprobs[i].extend(out.logprobs or ())
            if out.finished:
                lasts[i] = out
    finally:
        await outputs.aclose()
    wanted = req.params.logprobs is not None
    return [ChoiceResult(i, "".join(texts[i]), logprobs[i] if wanted else None, lasts[i]) for i in range(req.n)]


def _error_event(req: GenerationRequest, exc: Exception) -> bytes:
    # Headers (200) are gone already: OpenAI's streams report a late failure as an error event.
    if isinstance(exc, RequestCut):
        log.warning("%s: stream ended by the shutdown", req.id)
        return event(cut_by_shutdown(exc).body())
    log.error("%s: generation failed mid-stream", req.id, exc_info=exc)
    return event(APIError(500, str(exc), type="server_error").body())


async def _chat_events(req: GenerationRequest, outputs: Merged) -> AsyncIterator[bytes]:
    readers = [ToolCallStream(req.tools) if req.tools is not None else None for _ in range(req.n)]
    lasts: list[RequestOutput] = []
    try:
        for i in range(req.n):
            yield event(chat_chunk(req, i, {"role": "assistant", "content": ""}))
        async for i, out in outputs:
            reader = readers[i]
            if reader is not None:
                delta = reader.feed(out.text, out.finished)
            else:
                delta = {"content": out.text} if out.text else {}
            if out.finished:
                lasts.append(out)
                reason = tool_finish_reason(req, out.finish_reason) if reader and reader.called else out.finish_reason
                yield event(chat_chunk(req, i, delta, reason, out.logprobs))
            elif delta or out.logprobs:
                yield event(chat_chunk(req, i, delta, None, out.logprobs))
        if req.include_usage:
            yield event(usage_chunk(req, lasts, "chat.completion.chunk"))
        yield DONE
    except Exception as exc:
        yield _error_event(req, exc)
    finally:
        await outputs.aclose()


async def _completion_events(req: GenerationRequest, outputs: Merged) -> AsyncIterator[bytes]:
    text_offsets = [0] * req.n
    lasts: list[RequestOutput] = []
    try:
        if req.echo:
            for i in range(req.n):
                yield event(completion_chunk(req, i, req.echo))
        async for i, out in outputs:
            logprobs = None
            if out.logprobs:
                logprobs = completion_logprobs(out.logprobs, text_offsets[i], bool(req.params.logprobs))
            if out.text or logprobs or out.finished:
                yield event(completion_chunk(req, i, out.text, out.finish_reason, logprobs))
            text_offsets[i] += len(out.text)
            if out.finished:
                lasts.append(out)
        if req.include_usage:
            yield event(usage_chunk(req, lasts, "text_completion"))
        yield DONE
    except Exception as exc:
        yield _error_event(req, exc)
    finally:
        await outputs.aclose()


CHAT = _Endpoint(parse_chat, _chat_events, chat_response)
COMPLETIONS = _Endpoint(parse_completion, _completion_events, completion_response)


def routes(state: AppState) -> list[Route]:
    async def chat_completions(request: Request) -> Response:
        return await _generate(request, state, CHAT)

    async def completions(request: Request) -> Response:
        return await _generate(request, state, COMPLETIONS)

    def card(name: str) -> dict[str, Any]:
        engine = state.require_engine(name)
        return {"id": name, "object": "model", "created": int(state.ready_at or 0),
                "owned_by": "thawllm", "max_model_len": engine.max_model_len}

    async def list_models(request: Request) -> Response:
        state.require_engine(state.served_names[0] if state.served_names else None)  # 503 while starting
        return json_response({"object": "list", "data": [card(name) for name in state.served_names]})

    async def get_model(request: Request) -> Response:
        name = request.path_params["model"]
        state.require_engine(state.served_names[0] if state.served_names else None)  # 503 while starting
        if name not in state.served_names:
            raise APIError(404, f"The model `{name}` does not exist.", param="model", code="model_not_found")
        return json_response(card(name))

    return [Route("/v1/chat/completions", chat_completions, methods=["POST"]),
            Route("/v1/completions", completions, methods=["POST"]),
            Route("/v1/models", list_models, methods=["GET"]),
            Route("/v1/models/{model:path}", get_model, methods=["GET"]),
            *tokenize_routes(state)]


handler = Handler(routes=routes, name="openai")
