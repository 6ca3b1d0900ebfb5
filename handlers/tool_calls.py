"""OpenAI's tool calls: `tools`, `tool_choice` and `parallel_tool_calls` in, `tool_calls` out.

The tools reach the model through its own chat template where the template takes `tools` (Llama 3.x,
Qwen2/Qwen3, Hermes-style templates); a template that does not gets them in its system prompt, written in
the Hermes format (handlers/tool_prompt.py). What the model answers is read back in the format it was
told to use:

- `auto`: the model chooses. Hermes / Qwen: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`,
  any number of them, text before them is the message's content. Llama 3: a JSON object
  `{"name": ..., "parameters": {...}}` as the whole answer (several separated by `;`).
- `required`: a grammar makes the answer a JSON array of one or more calls of the given tools (one only
  when `parallel_tool_calls` is false), each `{"name": ..., "arguments": {...}}` following the tool's schema.
- a named function: a grammar makes the answer that function's arguments, following its schema.

The same reading serves the whole answer and the stream: a stream's deltas are the difference between
what the text read so far says and what was sent, so they reassemble to the non-streamed answer.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any, Callable

from runtime.engine.sampling_params import GrammarSpec
from runtime.server.errors import bad_request

TOOL_NAME = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")
HERMES_OPEN, HERMES_CLOSE = "<tool_call>", "</tool_call>"
EMPTY_PARAMETERS = {"type": "object", "properties": {}}


@dataclass(frozen=True)
class ToolRequest:
    """The tools of one chat request and how the model may use them."""

    tools: list[dict[str, Any]]          # as the request gave them: {"type": "function", "function": {...}}
    choice: str                          # "none", "auto", "required" or a function's name
    parallel: bool = True
    format: str = "hermes"               # how the model writes a call in `auto`: "hermes" or "llama3_json"

    @property
    def named(self) -> bool:
        return self.choice not in ("none", "auto", "required")

    @property
    def parsed(self) -> bool:
        """Whether the answer is read for tool calls."""
        return self.choice != "none"

    def parameters(self, name: str) -> dict[str, Any]:
        for tool in self.tools:
            if tool["function"]["name"] == name:
                return tool["function"].get("parameters") or EMPTY_PARAMETERS
        raise KeyError(name)

    def grammar(self) -> GrammarSpec | None:
        """The grammar that enforces a `required` or named choice (None for `auto` and `none`)."""
        if self.named:
            schema = self.parameters(self.choice)
        elif self.choice == "required":
            calls = [{"type": "object", "additionalProperties": False, "required": ["name", "arguments"],
                      "properties": {"name": {"const": t["function"]["name"]},
                                     "arguments": t["function"].get("parameters") or EMPTY_PARAMETERS}}
                     for t in self.tools]
            schema = {"type": "array", "minItems": 1, "items": {"anyOf": calls}}
            if not self.parallel:
                schema["maxItems"] = 1
        else:
            return None
        return GrammarSpec("json_schema", json.dumps(schema), param="tools")

    def reader(self) -> "CallReader":
        if self.named:
            return _named_reader(self.choice)
        if self.choice == "required":
            return _read_json_array
        return _read_llama3_json if self.format == "llama3_json" else _read_hermes


def parse_tool_request(body: dict[str, Any], template_format: str) -> ToolRequest | None:
    """Checks `tools`, `tool_choice` and `parallel_tool_calls`; None when the request has no tools."""
    tools = body.get("tools")
    choice = body.get("tool_choice")
    parallel = body.get("parallel_tool_calls", True)
    if not isinstance(parallel, bool):
        raise bad_request("'parallel_tool_calls' must be a boolean", "parallel_tool_calls")
    if tools is None or tools == []:
        if choice not in (None, "none"):
            raise bad_request("'tool_choice' is only allowed when 'tools' are specified", "tool_choice")
        return None
    if not isinstance(tools, list):
        raise bad_request("'tools' must be an array", "tools")
    names = [_check_tool(tool, i) for i, tool in enumerate(tools)]
    if len(set(names)) != len(names):
        raise bad_request("tool names must be unique", "tools")
    return ToolRequest(tools, _check_choice(choice, names), parallel, template_format)


def _check_tool(tool: Any, i: int) -> str:
    where = f"tools[{i}]"
    if not isinstance(tool, dict) or tool.get("type", "function") != "function":
        raise bad_request(f"{where} must be an object of type 'function'", where)
    function = tool.get("function")
    if not isinstance(function, dict):
        raise bad_request(f"{where}.function must be an object", f"{where}.function")
    name = function.get("name")
    if not isinstance(name, str) or not TOOL_NAME.match(name):
        raise bad_request(f"{where}.function.name must be 1-64 letters, digits, '_', '.' or '-', got {name!r}",
                          f"{where}.function.name")
    parameters = function.get("parameters")
    if parameters is not None and not isinstance(parameters, dict):
        raise bad_request(f"{where}.function.parameters must be a JSON schema object", f"{where}.function.parameters")
    return name


def _check_choice(choice: Any, names: list[str]) -> str:
    if choice is None:
        return "auto"
    if choice in ("none", "auto", "required"):
        return choice
    if isinstance(choice, dict) and choice.get("type") == "function" and isinstance(choice.get("function"), dict):
        name = choice["function"].get("name")
        if name in names:
            return name
        raise bad_request(f"tool_choice names the function {name!r}, which is not in 'tools' "
                          f"({', '.join(names)})", "tool_choice")
    raise bad_request("'tool_choice' must be 'none', 'auto', 'required' or "
                      "{\"type\": \"function\", \"function\": {\"name\": ...}}", "tool_choice")


# -- reading the answer ----------------------------------------------------------------------------------

@dataclass
class PartialCall:
    """A call as far as the text shows it: its name once complete, its arguments as written so far."""

    name: str | None = None
    arguments: str = ""
    complete: bool = False


@dataclass
class Reading:
    content: str
    calls: list[PartialCall] = field(default_factory=list)


#: (text so far, whether it is all of it) -> what it says
CallReader = Callable[[str, bool], Reading]


def _read_hermes(text: str, final: bool) -> Reading:
    start = text.find(HERMES_OPEN)
    if start < 0:
        return Reading(text if final else text[:len(text) - _partial_suffix(text, HERMES_OPEN)])
    reading = Reading(text[:start])
    while start >= 0:
        body_start = start + len(HERMES_OPEN)
        end = text.find(HERMES_CLOSE, body_start)
        call = _read_call(text[body_start:end if end >= 0 else len(text)])
        if call is not None:
            reading.calls.append(call)
        start = text.find(HERMES_OPEN, end) if end >= 0 else -1
    return reading


def _read_llama3_json(text: str, final: bool) -> Reading:
    body = text.lstrip()
    if not body:
        return Reading(text if final else "")
    if not body.startswith("{"):
        return Reading(text)
    return _read_objects(text, len(text) - len(body), " \t\r\n;")


def _read_json_array(text: str, final: bool) -> Reading:
    return _read_objects(text, _skip(text, 0, " \t\r\n["), " \t\r\n,")


def _read_objects(text: str, at: int, between: str) -> Reading:
    """The calls of the JSON objects from AT on, separated by characters of BETWEEN; the last may be partial."""
    reading = Reading("")
    while at < len(text) and text[at] == "{":
        end, complete = _value_extent(text, at)
        call = _read_call(text[at:end])
        if call is not None:
            reading.calls.append(call)
        if not complete:
            break
        at = _skip(text, end, between)
    return reading


def _named_reader(name: str) -> CallReader:
    def read(text: str, final: bool) -> Reading:
        return Reading("", [PartialCall(name, text, final)])

    return read


_NAME = re.compile(r'"name"\s*:\s*"((?:[^"\\]|\\.)*)"')
_ARGUMENTS = re.compile(r'"(?:arguments|parameters)"\s*:\s*')


def _read_call(body: str) -> PartialCall | None:
    """`{"name": ..., "arguments": {...}}` (or "parameters"), complete or cut anywhere."""
    if "{" not in body:
        return None
    call = PartialCall()
    arguments = _ARGUMENTS.search(body)
    outside = body  # where the call's own "name" is: not inside its arguments
    if arguments is not None and arguments.end() < len(body):
        end, complete = _value_extent(body, arguments.end())
        call.arguments = body[arguments.end():end]
        call.complete = complete
        outside = body[:arguments.start()] + body[end:]
    name = _NAME.search(outside)
    if name is not None:
        call.name = json.loads(f'"{name.group(1)}"')
    call.complete = call.complete and call.name is not None
    if arguments is None and call.name is not None and _value_extent(body, body.index("{"))[1]:
        call.arguments, call.complete = "{}", True  # a call without arguments
    return call


def _value_extent(text: str, start: int) -> tuple[int, bool]:
    """Where the JSON value (object, array or string) starting at `start` ends, and whether it does."""
    depth, in_string, escaped = 0, False, False
    for i in range(start, len(text)):
        c = text[i]
        if in_string:
            if escaped:
                escaped = False
            elif c == "\\":
                escaped = True
            elif c == '"':
                in_string = False
                if depth == 0:
                    return i + 1, True
        elif c == '"':
            in_string = True
        elif c in "{[":
            depth += 1
        elif c in "}]":
            depth -= 1
            if depth == 0:
                return i + 1, True
    return len(text), False


def _skip(text: str, at: int, chars: str) -> int:
    while at < len(text) and text[at] in chars:
        at += 1
    return at


def _partial_suffix(text: str, tag: str) -> int:
    """Length of the longest end of `text` that is a proper start of `tag` (held back: it may become one)."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0


def call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


# -- responses -------------------------------------------------------------------------------------------

def read_message(tools: ToolRequest, text: str) -> tuple[str | None, list[dict[str, Any]]]:
    """The content and tool calls of a whole answer. Calls that do not parse leave the text as content."""
    reading = tools.reader()(text, True)
    calls = []
    for call in reading.calls:
        if not call.complete or not _is_json(call.arguments):
            return text, []
        calls.append({"id": call_id(), "type": "function",
                      "function": {"name": call.name, "arguments": call.arguments}})
    if not calls:
        return text, []
    return reading.content.strip() or None, calls


def _is_json(text: str) -> bool:
    try:
        json.loads(text)
    except ValueError:
        return False
    return True


class ToolCallStream:
    """Turns an answer's text deltas into chat deltas: `content` and `tool_calls` as OpenAI streams them
    (a call's id, type and name once, then its arguments in fragments)."""

    def __init__(self, tools: ToolRequest) -> None:
        self._read = tools.reader()
        self._text = ""
        self._content_sent = 0
        self._sent: list[tuple[str, int]] = []   # per call: its id, and how much of its arguments went out

    @property
    def called(self) -> bool:
        return bool(self._sent)

    def feed(self, text: str, final: bool) -> dict[str, Any]:
        self._text += text
        reading = self._read(self._text, final)
        delta: dict[str, Any] = {}
        if len(reading.content) > self._content_sent and not self._sent:
            delta["content"] = reading.content[self._content_sent:]
            self._content_sent = len(reading.content)
        calls = []
        for index, call in enumerate(reading.calls):
            if index == len(self._sent):
                if call.name is None:
                    break
                self._sent.append((call_id(), 0))
                calls.append({"index": index, "id": self._sent[index][0], "type": "function",
                              "function": {"name": call.name, "arguments": ""}})
            arguments = call.arguments or ("{}" if final and call.name is not None else "")
            ident, sent = self._sent[index]
            if len(arguments) > sent:
                _add_arguments(calls, index, arguments[sent:])
                self._sent[index] = (ident, len(arguments))
        if calls:
            delta["tool_calls"] = calls
        return delta


def _add_arguments(calls: list[dict[str, Any]], index: int, fragment: str) -> None:
    for call in calls:
        if call["index"] == index:
            call["function"]["arguments"] += fragment
            return
    calls.append({"index": index, "function": {"arguments": fragment}})
