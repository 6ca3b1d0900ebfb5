"""OpenAI's response shapes: engine outputs in, `chat.completion(.chunk)` and `text_completion` objects out.
No I/O here; handlers/openai.py does that."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from handlers.openai_protocol import GenerationRequest
from handlers.tool_calls import read_message
from runtime.engine.outputs import RequestOutput, TokenLogprob


@dataclass
class ChoiceResult:
    """One choice of a whole (non-streamed) answer."""

    index: int
    text: str
    logprobs: list[TokenLogprob] | None
    last: RequestOutput


def usage(lasts: list[RequestOutput]) -> dict[str, Any]:
    """The prompt is counted once however many choices share it, as OpenAI counts it; its cached tokens are
    those the first choice found in the prefix cache."""
    first = min(lasts, key=lambda out: out.request_id)
    completion = sum(out.completion_tokens for out in lasts)
    return {"prompt_tokens": first.prompt_tokens, "completion_tokens": completion,
            "total_tokens": first.prompt_tokens + completion,
            "prompt_tokens_details": {"cached_tokens": first.cached_tokens}}


def tool_finish_reason(req: GenerationRequest, finish_reason: str | None) -> str | None:
    """A finished answer that called tools ends with "tool_calls"; a named tool_choice keeps "stop" (as
    OpenAI and vLLM answer it), and a cut one keeps "length"."""
    if finish_reason == "stop" and req.tools is not None and not req.tools.named:
        return "tool_calls"
    return finish_reason


def chat_logprobs(entries: list[TokenLogprob]) -> dict[str, Any]:
    def one(token: str, logprob: float, raw: bytes) -> dict[str, Any]:
        return {"token": token, "logprob": logprob, "bytes": list(raw)}

    return {"content": [one(e.token, e.logprob, e.bytes)
                        | {"top_logprobs": [one(t, lp, raw) for (_, t, lp), raw in zip(e.top, e.top_bytes)]}
                        for e in entries]}


def completion_logprobs(entries: list[TokenLogprob], text_offset: int, with_top: bool) -> dict[str, Any]:
    offsets, at = [], text_offset
    for e in entries:
        offsets.append(at)
        at += len(e.token)
    return {"tokens": [e.token for e in entries], "token_logprobs": [e.logprob for e in entries],
            "top_logprobs": [{t: lp for _, t, lp in e.top} for e in entries] if with_top else None,
            "text_offset": offsets}


def _header(req: GenerationRequest, object_name: str) -> dict[str, Any]:
    return {"id": req.id, "object": object_name, "created": req.created, "model": req.model}


def chat_response(req: GenerationRequest, results: list[ChoiceResult]) -> dict[str, Any]:
    choices = []
    for r in results:
        message: dict[str, Any] = {"role": "assistant", "content": r.text}
        finish_reason = r.last.finish_reason
        if req.tools is not None:
            content, calls = read_message(req.tools, r.text)
            if calls:
                message = {"role": "assistant", "content": content, "tool_calls": calls}
                finish_reason = tool_finish_reason(req, finish_reason)
        choices.append({"index": r.index, "message": message,
                        "logprobs": chat_logprobs(r.logprobs) if r.logprobs is not None else None,
                        "finish_reason": finish_reason})
    return _header(req, "chat.completion") | {"choices": choices, "usage": usage([r.last for r in results])}


def chat_chunk(req: GenerationRequest, index: int, delta: dict[str, Any], finish_reason: str | None = None,
               logprobs: list[TokenLogprob] | None = None) -> dict[str, Any]:
    chunk = _header(req, "chat.completion.chunk") | {
        "choices": [{"index": index, "delta": delta, "logprobs": chat_logprobs(logprobs) if logprobs else None,
                     "finish_reason": finish_reason}]}
    if req.include_usage:
        chunk["usage"] = None
    return chunk


def completion_response(req: GenerationRequest, results: list[ChoiceResult]) -> dict[str, Any]:
    choices = [{"index": r.index, "text": (req.echo or "") + r.text,
                "logprobs": completion_logprobs(r.logprobs, 0, bool(req.params.logprobs))
                if r.logprobs is not None else None,
                "finish_reason": r.last.finish_reason} for r in results]
    return _header(req, "text_completion") | {"choices": choices, "usage": usage([r.last for r in results])}


def completion_chunk(req: GenerationRequest, index: int, text: str, finish_reason: str | None = None,
                     logprobs: dict[str, Any] | None = None) -> dict[str, Any]:
    chunk = _header(req, "text_completion") | {
        "choices": [{"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}]}
    if req.include_usage:
        chunk["usage"] = None
    return chunk


def usage_chunk(req: GenerationRequest, lasts: list[RequestOutput], object_name: str) -> dict[str, Any]:
    return _header(req, object_name) | {"choices": [], "usage": usage(lasts)}
