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

from handlers.openai_protocol import (
    GenerationRequest,
    chat_chunk,
    chat_response,
    completion_chunk,
    completion_logprobs,
    completion_response,
    parse_chat,
    parse_completion,
    parse_json,
    usage_chunk,
)
from runtime.engine.outputs import RequestCut, RequestOutput, TokenLogprob
from runtime.engine.sampling_params import InvalidParams
from runtime.logs import get_logger
from runtime.server.disconnect import unless_disconnected
from runtime.server.engine_view import EngineView
from runtime.server.errors import APIError, bad_request, cut_by_shutdown
from runtime.server.handler import Handler
from runtime.server.sse import DONE, EventStreamResponse, event
from runtime.server.state import AppState

log = get_logger("openai")

Outputs = AsyncIterator[RequestOutput]


@dataclass(frozen=True)
class _Endpoint:
    """What differs between chat and plain completions: parsing, the stream's events, the JSON body."""

    parse: Callable[[dict[str, Any], EngineView, str], GenerationRequest]
    events: Callable[[GenerationRequest, RequestOutput, Outputs], AsyncIterator[bytes]]
    respond: Callable[[GenerationRequest, str, list[TokenLogprob] | None, RequestOutput], dict[str, Any]]


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
    outputs = engine.generate(req.prompt, req.params, req.id)
    try:
        first = await anext(outputs)
    except InvalidParams as exc:  # prompt too long for the context, or a parameter the engine refuses
        raise bad_request(str(exc), exc.param) from None
    if req.stream:
        return EventStreamResponse(endpoint.events(req, first, outputs))
    text, logprobs, last = await _collect(req, first, outputs)
    return json_response(endpoint.respond(req, text, logprobs, last))


async def _collect(req: GenerationRequest, out: RequestOutput,
                   outputs: Outputs) -> tuple[str, list[TokenLogprob] | None, RequestOutput]:
    texts: list[str] = []
    logprobs: list[TokenLogprob] = []
    try:
        while True:
            texts.append(out.text)
            logprobs.extend(out.logprobs or ())
            if out.finished:
                return "".join(texts), logprobs if req.params.logprobs is not None else None, out
            out = await anext(outputs)
    finally:
        await outputs.aclose()


def _error_event(req: GenerationRequest, exc: Exception) -> bytes:
    # Headers (200) are gone already: OpenAI's streams report a late failure as an error event.
    if isinstance(exc, RequestCut):
        log.warning("%s: stream ended by the shutdown", req.id)
        return event(cut_by_shutdown(exc).body())
    log.error("%s: generation failed mid-stream", req.id, exc_info=exc)
    return event(APIError(500, str(exc), type="server_error").body())


async def _chat_events(req: GenerationRequest, out: RequestOutput, outputs: Outputs) -> AsyncIterator[bytes]:
    try:
        yield event(chat_chunk(req, {"role": "assistant", "content": ""}))
        while True:
            delta = {"content": out.text} if out.text else {}
            if out.finished:
                yield event(chat_chunk(req, delta, out.finish_reason, out.logprobs))
                break
            if out.text or out.logprobs:
                yield event(chat_chunk(req, delta, None, out.logprobs))
            out = await anext(outputs)
        if req.include_usage:
            yield event(usage_chunk(req, out, "chat.completion.chunk"))
        yield DONE
    except Exception as exc:
        yield _error_event(req, exc)
    finally:
        await outputs.aclose()


async def _completion_events(req: GenerationRequest, out: RequestOutput,
                             outputs: Outputs) -> AsyncIterator[bytes]:
    text_offset = 0
    try:
        while True:
            logprobs = None
            if out.logprobs:
                logprobs = completion_logprobs(out.logprobs, text_offset, bool(req.params.logprobs))
            if out.text or logprobs or out.finished:
                yield event(completion_chunk(req, out.text, out.finish_reason, logprobs))
            text_offset += len(out.text)
            if out.finished:
                break
            out = await anext(outputs)
        if req.include_usage:
            yield event(usage_chunk(req, out, "text_completion"))
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
            Route("/v1/models/{model:path}", get_model, methods=["GET"])]


handler = Handler(routes=routes, name="openai")
