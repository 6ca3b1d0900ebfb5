"""vLLM's /tokenize, /detokenize and /version, in vLLM's request and response shapes.

/tokenize takes a `prompt` (with the tokenizer's special tokens unless `add_special_tokens` is false) or
chat `messages` (and `tools`) through the chat template (`add_generation_prompt`, default true); it
answers `{"count", "max_model_len", "tokens", "token_strs"}` (`token_strs` when `return_token_strs`).
/detokenize takes `tokens` and answers `{"prompt"}`. Outside /v1, like vLLM's, so no API key is asked.
"""

from __future__ import annotations

import asyncio
from typing import Any

import orjson
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

import runtime
from handlers.openai_protocol import Fields, chat_prompt, check_model, parse_json
from handlers.tool_calls import parse_tool_request
from handlers.tool_prompt import template_format
from runtime.server.engine_view import EngineView
from runtime.server.errors import bad_request
from runtime.server.state import AppState


def _json(content: Any) -> Response:
    return Response(orjson.dumps(content), media_type="application/json")


def tokenize(body: dict[str, Any], engine: EngineView, served: str) -> dict[str, Any]:
    f = Fields(body)
    check_model(f, served)
    tokenizer = engine.tokenizer
    if "messages" in body:
        tools = parse_tool_request(body, template_format(tokenizer.chat_template))
        text = chat_prompt(f, tokenizer, tools, f.get("add_generation_prompt", "bool", True))
        tokens = tokenizer.encode(text, add_special_tokens=f.get("add_special_tokens", "bool", False))
    else:
        prompt = f.get("prompt", "str")
        if prompt is None:
            raise bad_request("/tokenize needs a 'prompt' string or chat 'messages'", "prompt")
        tokens = tokenizer.encode(prompt, add_special_tokens=f.get("add_special_tokens", "bool", True))
    strs = [tokenizer.token_text(t) for t in tokens] if f.get("return_token_strs", "bool", False) else None
    return {"count": len(tokens), "max_model_len": engine.max_model_len, "tokens": tokens, "token_strs": strs}


def detokenize(body: dict[str, Any], engine: EngineView, served: str) -> dict[str, Any]:
    f = Fields(body)
    check_model(f, served)
    tokens = f.get("tokens", "list")
    vocab = engine.tokenizer.vocab_size
    if tokens is None or not all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t < vocab
                                 for t in tokens):
        raise bad_request(f"'tokens' must be a list of token ids (0-{vocab - 1})", "tokens")
    return {"prompt": engine.tokenizer.decode(tokens)}


def tokenize_routes(state: AppState) -> list[Route]:
    def served(engine: EngineView) -> str:
        return state.model_name or engine.model_name

    async def tokenize_route(request: Request) -> Response:
        body = parse_json(await request.body())
        engine = state.require_engine(body.get("model"))
        # rendered and tokenised off the event loop, as a generation request is
        return _json(await asyncio.to_thread(tokenize, body, engine, served(engine)))

    async def detokenize_route(request: Request) -> Response:
        body = parse_json(await request.body())
        engine = state.require_engine(body.get("model"))
        return _json(detokenize(body, engine, served(engine)))

    async def version(request: Request) -> Response:
        return _json({"version": runtime.__version__})

    return [Route("/tokenize", tokenize_route, methods=["POST"]),
            Route("/detokenize", detokenize_route, methods=["POST"]),
            Route("/version", version, methods=["GET"])]
