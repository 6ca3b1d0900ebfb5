"""OpenAI's request shapes: JSON bodies in, SamplingParams and prompts (token ids) out (handlers/openai_responses.py
shapes the answers). No I/O here; handlers/openai.py does that, and runs the parsing (template rendering and
tokenising included) off the event loop."""

from __future__ import annotations

import dataclasses
import json
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import orjson

from handlers.structured_outputs import request_grammar
from handlers.tool_calls import ToolRequest, parse_tool_request
from handlers.tool_prompt import render_tools, template_format
from runtime.engine.sampling_params import GrammarSpec, InvalidParams, SamplingParams
from runtime.engine.tokenizer import ChatTemplateError, Tokenizer
from runtime.server.engine_view import EngineView
from runtime.server.errors import APIError, bad_request

#: roles the chat template sees; OpenAI's newer "developer" role is the old "system"
CHAT_ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant", "tool": "tool"}
MAX_N = 128                           # OpenAI's limit for `n`
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
    n: int = 1
    echo: str | None = None          # completions: the prompt's text, put before each choice's text
    tools: ToolRequest | None = None

    def choice_params(self, index: int) -> SamplingParams:
        """Choice `index`'s sampling: a seeded request seeds its choices seed, seed + 1, ... (as vLLM does)."""
        if index == 0 or self.params.seed is None:
            return self.params
        return dataclasses.replace(self.params, seed=self.params.seed + index)

    def request_id(self, index: int) -> str:
        return self.id if self.n == 1 else f"{self.id}-{index}"


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


class Fields:
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


def check_model(fields: Fields, served: str) -> str:
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
    Refusal("best_of", "int", lambda n: n != 1,
            "only best_of=1 (ranking samples by their log-probability is not implemented: ask for n choices "
            "with logprobs and rank them)"),
    Refusal("suffix", "str", bool, "no insertion"),
    Refusal("functions", "list", bool, "the deprecated 'functions' are not served: use 'tools'"),
)
CHAT_REFUSALS = UNSERVED + (Refusal("echo", "bool", bool, "echo is for /v1/completions"),)
COMPLETION_REFUSALS = UNSERVED
RESPONSE_FORMATS = ("text", "json_object", "json_schema")


def _check_request(f: Fields, refusals: Sequence[Refusal]) -> None:
    """The checks every route makes, in one place: types of the shared parameters, then what is refused."""
    f.get("user", "str")
    _check_response_format(f)
    n = f.get("n", "int", 1)
    if not 1 <= n <= MAX_N:
        raise bad_request(f"'n' must be between 1 and {MAX_N}, got {n}", "n")
    for refusal in refusals:
        value = f.get(refusal.name, refusal.kind)
        if value is not None and refusal.refused(value):
            raise bad_request(f"'{refusal.name}' is not supported by this server: {refusal.why}", refusal.name,
                              "unsupported_parameter")


def _check_response_format(f: Fields) -> None:
    fmt = f.get("response_format", "dict")
    if fmt is not None and fmt.get("type") not in RESPONSE_FORMATS:
        raise bad_request(f"'response_format.type' must be one of {', '.join(RESPONSE_FORMATS)}, got "
                          f"{fmt.get('type')!r}", "response_format")


def _logit_bias(f: Fields) -> dict[int, float]:
    bias = f.get("logit_bias", "dict", {})
    out = {}
    for token, value in bias.items():
        try:
            out[int(token)] = float(value)
        except (TypeError, ValueError):
            raise bad_request("'logit_bias' maps token ids to numbers between -100 and 100", "logit_bias") from None
    return out


def _token_ids(f: Fields, name: str) -> list[int]:
    ids = f.get(name, "list", [])
    if not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
        raise bad_request(f"'{name}' must be a list of token ids", name)
    return ids


def _sampling_params(fields: Fields, max_tokens: int, logprobs: int | None,
                     grammar: GrammarSpec | None = None) -> SamplingParams:
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
            min_p=f.get("min_p", "number", 0.0),
            min_tokens=f.get("min_tokens", "int", 0),
            stop_token_ids=_token_ids(f, "stop_token_ids"),
            logit_bias=_logit_bias(f),
            grammar=grammar,
        )
    except InvalidParams as exc:
        raise bad_request(str(exc), exc.param) from None


def _max_tokens(fields: Fields) -> int | None:
    """max_completion_tokens replaced max_tokens in chat; both are accepted on both routes, each checked,
    and the newer name wins where both are set."""
    values = {}
    for name in ("max_completion_tokens", "max_tokens"):
        value = fields.get(name, "int")
        if value is not None and value < 1:
            raise bad_request(f"'{name}' must be at least 1, got {value}", name)
        values[name] = value
    return values["max_completion_tokens"] or values["max_tokens"]


def _stream_flags(fields: Fields) -> tuple[bool, bool]:
    stream = fields.get("stream", "bool", False)
    options = fields.get("stream_options", "dict", {})
    include_usage = options.get("include_usage", False)
    if not isinstance(include_usage, bool):
        raise bad_request("'stream_options.include_usage' must be a boolean", "stream_options")
    return stream, stream and include_usage


def parse_chat(body: dict[str, Any], engine: EngineView, served: str) -> GenerationRequest:
    f = Fields(body)
    model = check_model(f, served)
    _check_request(f, CHAT_REFUSALS)
    tokenizer = engine.tokenizer
    tools = parse_tool_request(body, template_format(tokenizer.chat_template))
    # The template writes the special tokens (BOS included) itself.
    prompt = tokenizer.encode(chat_prompt(f, tokenizer, tools, True), add_special_tokens=False)
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
    grammar = request_grammar(body)
    tool_grammar = tools.grammar() if tools else None
    if grammar is not None and tool_grammar is not None:
        raise bad_request(f"'{grammar.param}' and a required or named 'tool_choice' both fix the answer's form: "
                          "send one of them", grammar.param)
    stream, include_usage = _stream_flags(f)
    return GenerationRequest(f"chatcmpl-{uuid.uuid4().hex}", model, prompt,
                             _sampling_params(f, max_tokens, logprobs, grammar or tool_grammar), stream,
                             include_usage, n=f.get("n", "int", 1), tools=tools if tools and tools.parsed else None)


def chat_prompt(f: Fields, tokenizer: Tokenizer, tools: ToolRequest | None, add_generation_prompt: bool) -> str:
    """The request's messages (and tools) through the model's chat template."""
    messages, template_tools = render_tools(_chat_messages(f.get("messages", "list")),
                                            tools.tools if tools else None, tokenizer.chat_template)
    try:
        return tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt,
                                             tools=template_tools)
    except ChatTemplateError as exc:
        raise bad_request(str(exc), "messages") from None


def _chat_messages(raw: list | None) -> list[dict[str, Any]]:
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
        calls = message.get("tool_calls") if role == "assistant" else None
        content = message.get("content")
        out: dict[str, Any] = {"role": role, "content": "" if content is None and calls else _message_text(content, i)}
        if calls:
            out["tool_calls"] = _history_calls(calls, i)
        if role == "tool":
            out["tool_call_id"] = str(message.get("tool_call_id", ""))
        messages.append(out)
    return messages


def _history_calls(calls: Any, i: int) -> list[dict[str, Any]]:
    """An assistant's earlier tool calls, with their arguments as JSON objects (how templates write them)."""
    where = f"messages[{i}].tool_calls"
    if not isinstance(calls, list):
        raise bad_request(f"{where} must be an array", where)
    out = []
    for call in calls:
        function = call.get("function") if isinstance(call, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            raise bad_request(f"{where}: each call needs a function with a name", where)
        arguments = function.get("arguments", "{}")
        try:
            arguments = json.loads(arguments) if isinstance(arguments, str) else arguments
        except ValueError:
            raise bad_request(f"{where}: arguments must be a JSON object, got {arguments!r}", where) from None
        out.append({"id": call.get("id", ""), "type": "function",
                    "function": {"name": function["name"], "arguments": arguments}})
    return out


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
    f = Fields(body)
    model = check_model(f, served)
    _check_request(f, COMPLETION_REFUSALS)
    max_tokens = _max_tokens(f)
    logprobs = f.get("logprobs", "int")
    if logprobs is not None and not 0 <= logprobs <= MAX_COMPLETIONS_LOGPROBS:
        raise bad_request(f"'logprobs' must be between 0 and {MAX_COMPLETIONS_LOGPROBS}, got {logprobs}", "logprobs")
    prompt = _completion_prompt(body.get("prompt"))
    echo = None
    if f.get("echo", "bool", False):
        if logprobs is not None:
            raise bad_request("'echo' with 'logprobs' is not supported: it needs the prompt's log-probabilities, "
                              "which this server does not compute", "echo", "unsupported_parameter")
        echo = prompt if isinstance(prompt, str) else engine.tokenizer.decode(prompt, skip_special_tokens=False)
    stream, include_usage = _stream_flags(f)
    params = _sampling_params(f, max_tokens or COMPLETIONS_DEFAULT_MAX_TOKENS, logprobs, request_grammar(body))
    if isinstance(prompt, str):
        prompt = engine.tokenizer.encode(prompt)
    return GenerationRequest(f"cmpl-{uuid.uuid4().hex}", model, prompt, params, stream, include_usage,
                             n=f.get("n", "int", 1), echo=echo)


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
