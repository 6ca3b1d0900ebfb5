"""One streamed completion, timed on the client: when it was sent, when its first token arrived, when it
finished, and the token counts the server reported."""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field

import httpx
import orjson

#: a prompt as text, or as token ids (exact lengths, no tokenizer round trip)
Prompt = str | list[int]


@dataclass
class RequestTiming:
    sent_at: float
    first_token_at: float | None = None
    finished_at: float | None = None
    prompt_tokens: int | None = None
    completion_tokens: int = 0
    error: str | None = None
    text: str = ""  # the completion
    #: when each chunk that carried a token arrived, the first included (one chunk per token with `every_token`)
    token_times: list[float] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return self.error is None and self.first_token_at is not None


async def stream_completion(client: httpx.AsyncClient, url: str, prompt: Prompt, max_tokens: int,
                            timeout: float = 600.0, every_token: bool = False,
                            model: str | None = None) -> RequestTiming:
    """POST /v1/completions with stream=true. The first token is the first chunk that carries text or, with
    `every_token`, the first chunk at all: asking for logprobs makes the server send a chunk for each token,
    even one whose text is still incomplete (part of a UTF-8 character). A failed request never raises: the
    reason lands in `error`. `model` names one model of a several-model instance."""
    body = {"prompt": prompt, "max_tokens": max_tokens, "stream": True, "temperature": 0.0,
            "ignore_eos": True, "stream_options": {"include_usage": True}}
    if model is not None:
        body["model"] = model
    if every_token:
        body["logprobs"] = 1
    timing = RequestTiming(sent_at=time.time())
    try:
        async with client.stream("POST", f"{url}/v1/completions", content=orjson.dumps(body), timeout=timeout,
                                 headers=_headers()) as response:
            if response.status_code != 200:
                detail = (await response.aread()).decode(errors="replace")[:200]
                timing.error = f"HTTP {response.status_code}: {detail}"
                return timing
            async for line in response.aiter_lines():
                _take_event(timing, line)
    except httpx.HTTPError as exc:
        timing.error = f"{type(exc).__name__}: {exc}"
    timing.finished_at = time.time()
    if timing.error is None and timing.first_token_at is None:
        timing.error = "the stream ended without a token"
    return timing


def _headers() -> dict[str, str]:
    # the servers the bench starts inherit this environment, API_KEY included
    key = os.environ.get("API_KEY")
    return {"Content-Type": "application/json", **({"Authorization": f"Bearer {key}"} if key else {})}


def _take_event(timing: RequestTiming, line: str) -> None:
    if not line.startswith("data: ") or line == "data: [DONE]":
        return
    chunk = orjson.loads(line[6:])
    if "error" in chunk:
        timing.error = str(chunk["error"].get("message", chunk["error"]))
        return
    choices = chunk.get("choices", ())
    if any(c.get("text") or c.get("logprobs") for c in choices):
        timing.token_times.append(time.time())
        if timing.first_token_at is None:
            timing.first_token_at = timing.token_times[0]
    timing.text += "".join(c.get("text") or "" for c in choices)
    if chunk.get("usage"):
        timing.prompt_tokens = chunk["usage"]["prompt_tokens"]
        timing.completion_tokens = chunk["usage"]["completion_tokens"]
