"""OpenAI's request and response shapes: JSON bodies in, SamplingParams and prompts (token ids) out; engine
outputs in, `chat.completion(.chunk)` and `text_completion` objects out. No I/O here; handlers/openai.py does
that, and runs the parsing (template rendering and tokenising included) off the event loop."""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import orjson

from runtime.engine.outputs import RequestOutput, TokenLogprob
from runtime.engine.sampling_params import InvalidParams, SamplingParams
from runtime.engine.tokenizer import ChatTemplateError
from runtime.server.engine_view import EngineView
from runtime.server.errors import APIError, bad_request

#: roles the chat template sees; OpenAI's newer "developer" role is the old "system"
CHAT_ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant"}
COMPLETIONS_DEFAULT_MAX_TOKENS = 16   # OpenAI's default for /v1/completions
MAX_COMPLETIONS_LOGPROBS = 5          # OpenAI's limit for /v1/completions `logprobs`
MAX_TOP_LOGPROBS = 20                 # and for /v1/chat/completions `top_logprobs`


@dataclass
class GenerationRequest:
    """One parsed request: what to feed the engine and how to shape the answer."""

    id: str
    model: str
    prompt: str | list[int]
    params: SamplingParams
    stream: bool
    include_usage: bool
    created: int = field(default_factory=lambda: int(time.time()))


def parse_json(raw: bytes) -> dict[str, Any]:
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise bad_request(f"We could not parse the JSON body of your request: {exc}") from None
    if not isinstance(body, dict):
        raise bad_request("The request body must be a JSON object")
    return body


_KIND_WORDS = {"int": "an integer", "number": "a number", "bool": "a boolean", "str": "a string",
               "list": "an array", "dict": "an object"}


class _Fields:
    """Typed access to a request body; a wrong type is a 400 naming the parameter."""

    def __init__(self, body: dict[str, Any]) -> None:
        self.body = body

    def get(self, name: str, kind: str, default: Any = None) -> Any:
        value = self.body.get(name)
        if value is None:
            return default
        ok = {"int": isinstance(value, int) and not isinstance(value, bool),
              "number": isinstance(value, (int, float)) and not isinstance(value, bool),
              "bool": isinstance(value, bool),
              "str": isinstance(value, str),
              "list": isinstance(value, list),
              "dict": isinstance(value, dict)}[kind]
        if not ok:
            raise bad_request(f"'{name}' must be {_KIND_WORDS[kind]}, got {value!r}", name)
        return float(value) if kind == "number" else value


def _check_model(fields: _Fields, served: str) -> str:
    model = fields.get("model", "str", served)
    if model != served:
        raise APIError(404, f"The model `{model}` does not exist. This server serves `{served}`.",
                       param="model", code="model_not_found")
    return model


# -- validation shared by both routes ---------------------------------------------------------------------

@dataclass(frozen=True)
class Refusal:
    """A parameter refused with a 400 rather than ignored, since ignoring it would change the answer the
    client asked for. `kind` is checked first (a wrong type is an invalid request, not an unsupported one);
    `refused(value)` then says whether this server cannot serve the value."""

    name: str
    kind: str
    refused: Callable[[Any], bool]
    why: str


#: what neither route serves
UNSERVED = (
    Refusal("n", "int", lambda n: n != 1,
            "only n=1 (send several requests, with different seeds if you want different samples)"),
    Refusal("best_of", "int", lambda n: n != 1, "only best_of=1"),
    Refusal("echo", "bool", bool, "echo is not implemented"),
    Refusal("suffix", "str", bool, "no insertion"),
    Refusal("tools", "list", bool, "no tool calling"),
    Refusal("functions", "list", bool, "no function calling"),
    Refusal("logit_bias", "dict", bool, "no logit bias"),
    Refusal("response_format", "dict", lambda fmt: fmt["type"] != "text", "no structured output"),
)
CHAT_REFUSALS = UNSERVED
COMPLETION_REFUSALS = UNSERVED
RESPONSE_FORMATS = ("text", "json_object", "json_schema")


def _check_request(f: _Fields, refusals: Sequence[Refusal]) -> None:
    """The checks every route makes, in one place: types of the shared parameters, then what is refused."""
    f.get("user", "str")
    _check_response_format(f)
    for refusal in refusals:
        value = f.get(refusal.name, refusal.kind)
        if value is not None and refusal.refused(value):
            raise bad_request(f"'{refusal.name}' is not supported by this server: {refusal.why}", refusal.name,
                              "unsupported_parameter")


def _check_response_format(f: _Fields) -> None:
    fmt = f.get("response_format", "dict")
    if fmt is not None and fmt.get("type") not in RESPONSE_FORMATS:
        raise bad_request(f"'response_format.type' must be one of {', '.join(RESPONSE_FORMATS)}, got "
                          f"{fmt.get('type')!r}", "response_format")


def _sampling_params(fields: _Fields, max_tokens: int, logprobs: int | None) -> SamplingParams:
    f = fields
    stop = f.body.get("stop")
    if stop is not None and not isinstance(stop, str) and not (
            isinstance(stop, list) and all(isinstance(s, str) for s in stop)):
        raise bad_request("'stop' must be a string or a list of strings", "stop")
    seed = f.get("seed", "int")
    if seed is not None and not -(1 << 63) <= seed < (1 << 64):
        raise bad_request("'seed' must fit in 64 bits", "seed")
    try:
        return SamplingParams(
            max_tokens=max_tokens,
            temperature=f.get("temperature", "number", 1.0),
            top_p=f.get("top_p", "number", 1.0),
            top_k=f.get("top_k", "int", 0),
            seed=seed,
            presence_penalty=f.get("presence_penalty", "number", 0.0),
            frequency_penalty=f.get("frequency_penalty", "number", 0.0),
            repetition_penalty=f.get("repetition_penalty", "number", 1.0),
            stop=[stop] if isinstance(stop, str) else list(stop or []),
            ignore_eos=f.get("ignore_eos", "bool", False),
            logprobs=logprobs,
        )
    except InvalidParams as exc:
        raise bad_request(str(exc), exc.param) from None


def _max_tokens(fields: _Fields) -> int | None:
    """max_completion_tokens replaced max_tokens in chat; both are accepted on both routes, each checked,
    and the newer name wins where both are set."""
    values = {}
    for name in ("max_completion_tokens", "max_tokens"):
        value = fields.get(name, "int")
        if value is not None and value < 1:
            raise bad_request(f"'{name}' must be at least 1, got {value}", name)
        values[name] = value
    return values["max_completion_tokens"] or values["max_tokens"]


def _stream_flags(fields: _Fields) -> tuple[bool, bool]:
    stream = fields.get("stream", "bool", False)
    options = fields.get("stream_options", "dict", {})
    include_usage = options.get("include_usage", False)
    if not isinstance(include_usage, bool):
        raise bad_request("'stream_options.include_usage' must be a boolean", "stream_options")
    return stream, stream and include_usage


def parse_chat(body: dict[str, Any], engine: EngineView, served: str) -> GenerationRequest:
    f = _Fields(body)
    model = _check_model(f, served)
    _check_request(f, CHAT_REFUSALS)
    messages = _chat_messages(f.get("messages", "list"))
    try:
        prompt_text = engine.tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    except ChatTemplateError as exc:
        raise bad_request(str(exc), "messages") from None
    # The template writes the special tokens (BOS included) itself.
    prompt = engine.tokenizer.encode(prompt_text, add_special_tokens=False)
    max_tokens = _max_tokens(f)
    if max_tokens is None:  # OpenAI's default: whatever room the context has left
        max_tokens = max(1, engine.max_model_len - len(prompt))
    logprobs = None
    if f.get("logprobs", "bool", False):
        top = f.get("top_logprobs", "int", 0)
        if not 0 <= top <= MAX_TOP_LOGPROBS:
            raise bad_request(f"'top_logprobs' must be between 0 and {MAX_TOP_LOGPROBS}, got {top}", "top_logprobs")
        logprobs = top
    elif f.get("top_logprobs", "int") is not None:
        raise bad_request("'top_logprobs' needs 'logprobs': true", "top_logprobs")
    stream, include_usage = _stream_flags(f)
    return GenerationRequest(f"chatcmpl-{uuid.uuid4().hex}", model, prompt,
                             _sampling_params(f, max_tokens, logprobs), stream, include_usage)


def _chat_messages(raw: list | None) -> list[dict[str, str]]:
    if not raw:
        raise bad_request("'messages' must be a non-empty list", "messages")
    messages = []
    for i, message in enumerate(raw):
        if not isinstance(message, dict):
            raise bad_request(f"messages[{i}] must be an object", f"messages[{i}]")
        role = CHAT_ROLES.get(message.get("role"))
        if role is None:
            raise bad_request(f"messages[{i}].role must be one of {', '.join(CHAT_ROLES)}, got "
                              f"{message.get('role')!r}", f"messages[{i}].role")
        if message.get("tool_calls"):
            raise bad_request("tool calls are not supported", f"messages[{i}].tool_calls", "unsupported_parameter")
        messages.append({"role": role, "content": _message_text(message.get("content"), i)})
    return messages


def _message_text(content: Any, i: int) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):  # content parts: only text can be served by a text model
        texts = []
        for part in content:
            if not (isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str)):
                raise bad_request(f"messages[{i}].content: only text parts are supported", f"messages[{i}].content")
            texts.append(part["text"])
        return "".join(texts)
    raise bad_request(f"messages[{i}].content must be a string or a list of text parts", f"messages[{i}].content")


def parse_completion(body: dict[str, Any], engine: EngineView, served: str) -> GenerationRequest:
    f = _Fields(body)
    model = _check_model(f, served)
    _check_request(f, COMPLETION_REFUSALS)
    max_tokens = _max_tokens(f)
    logprobs = f.get("logprobs", "int")
    if logprobs is not None and not 0 <= logprobs <= MAX_COMPLETIONS_LOGPROBS:
        raise bad_request(f"'logprobs' must be between 0 and {MAX_COMPLETIONS_LOGPROBS}, got {logprobs}", "logprobs")
    stream, include_usage = _stream_flags(f)
    prompt = _completion_prompt(body.get("prompt"))
    if isinstance(prompt, str):
        prompt = engine.tokenizer.encode(prompt)
    return GenerationRequest(f"cmpl-{uuid.uuid4().hex}", model, prompt,
                             _sampling_params(f, max_tokens or COMPLETIONS_DEFAULT_MAX_TOKENS, logprobs),
                             stream, include_usage)


def _completion_prompt(prompt: Any) -> str | list[int]:
    # One prompt per request: a string, a list of token ids, or a batch of exactly one of those.
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        return prompt
    if isinstance(prompt, list) and len(prompt) > 1 and all(isinstance(p, (str, list)) for p in prompt):
        raise bad_request("batched prompts are not supported: send one prompt per request", "prompt",
                          "unsupported_parameter")
    raise bad_request("'prompt' must be a string or a list of token ids", "prompt")


# -- responses -------------------------------------------------------------------------------------------

def usage(out: RequestOutput) -> dict[str, Any]:
    return {"prompt_tokens": out.prompt_tokens, "completion_tokens": out.completion_tokens,
            "total_tokens": out.prompt_tokens + out.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": out.cached_tokens}}


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


def chat_response(req: GenerationRequest, text: str, logprobs: list[TokenLogprob] | None,
                  last: RequestOutput) -> dict[str, Any]:
    return {"id": req.id, "object": "chat.completion", "created": req.created, "model": req.model,
            "choices": [{"index": 0, "message": {"role": "assistant", "content": text},
                         "logprobs": chat_logprobs(logprobs) if logprobs is not None else None,
                         "finish_reason": last.finish_reason}],
            "usage": usage(last)}


def chat_chunk(req: GenerationRequest, delta: dict[str, Any], finish_reason: str | None = None,
               logprobs: list[TokenLogprob] | None = None) -> dict[str, Any]:
    chunk = {"id": req.id, "object": "chat.completion.chunk", "created": req.created, "model": req.model,
             "choices": [{"index": 0, "delta": delta,
                          "logprobs": chat_logprobs(logprobs) if logprobs else None,
                          "finish_reason": finish_reason}]}
    if req.include_usage:
        chunk["usage"] = None
    return chunk


def completion_response(req: GenerationRequest, text: str, logprobs: list[TokenLogprob] | None,
                        last: RequestOutput) -> dict[str, Any]:
    return {"id": req.id, "object": "text_completion", "created": req.created, "model": req.model,
            "choices": [{"index": 0, "text": text,
                         "logprobs": completion_logprobs(logprobs, 0, bool(req.params.logprobs))
                         if logprobs is not None else None,
                         "finish_reason": last.finish_reason}],
            "usage": usage(last)}


def completion_chunk(req: GenerationRequest, text: str, finish_reason: str | None = None,
                     logprobs: dict[str, Any] | None = None) -> dict[str, Any]:
    chunk = {"id": req.id, "object": "text_completion", "created": req.created, "model": req.model,
             "choices": [{"index": 0, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}]}
    if req.include_usage:
        chunk["usage"] = None
    return chunk


def usage_chunk(req: GenerationRequest, last: RequestOutput, object_name: str) -> dict[str, Any]:
    return {"id": req.id, "object": object_name, "created": req.created, "model": req.model, "choices": [],
            "usage": usage(last)}
