"""A custom handler: a plain JSON text-generation function, served beside the OpenAI API.

    HANDLER=examples.custom_handler.handler:handler faas-bootstrap --model ./my-model

- POST /generate {"prompt": "...", "max_tokens": 64}  ->  {"text": "...", "finish_reason": "...", "tokens": n}
- on AWS Lambda, a direct invocation (`aws lambda invoke --payload '{"prompt": "..."}'`) goes to `event`;
  Function URL requests go to the routes, like on Knative.
- the OpenAI routes stay available because `routes` includes them.

A handler sees the engine only through `state.require_engine()`: generate(), abort(), tokenizer, stats().
"""

from __future__ import annotations

from typing import Any

import orjson
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from handlers import openai
from runtime.engine import InvalidParams, SamplingParams
from runtime.server.errors import bad_request
from runtime.server.handler import Handler, LambdaContext
from runtime.server.state import AppState


async def _complete(state: AppState, payload: Any) -> dict[str, Any]:
    if not isinstance(payload, dict) or not isinstance(payload.get("prompt"), str):
        raise bad_request("expected a JSON object with a string 'prompt'", "prompt")
    engine = state.require_engine()
    try:
        params = SamplingParams(max_tokens=int(payload.get("max_tokens", 64)), temperature=0.0)
        text, last = [], None
        async for out in engine.generate(payload["prompt"], params):
            text.append(out.text)
            last = out
    except InvalidParams as exc:
        raise bad_request(str(exc), exc.param) from None
    return {"text": "".join(text), "finish_reason": last.finish_reason, "tokens": last.completion_tokens}


def routes(state: AppState) -> list[Route]:
    async def generate(request: Request) -> Response:
        try:
            payload = orjson.loads(await request.body())
        except orjson.JSONDecodeError:
            raise bad_request("the body is not JSON") from None
        return Response(orjson.dumps(await _complete(state, payload)), media_type="application/json")

    return [Route("/generate", generate, methods=["POST"]), *openai.routes(state)]


async def event(payload: Any, context: LambdaContext, state: AppState) -> dict[str, Any]:
    return await _complete(state, payload) | {"request_id": context.aws_request_id}


handler = Handler(routes=routes, event=event, name="custom-example")
