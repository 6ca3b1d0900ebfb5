"""Chat messages with tools, as the chat template gets them.

A template that takes `tools` (its source names them: Llama 3.x, Qwen2/Qwen3, Hermes) gets the tools and
the history as OpenAI sends them, except that each call's `arguments` is the JSON object rather than its
text (the templates write it with `tojson`). A template that does not (the embedded SmolLM2's, plain
ChatML) gets the tools in its system prompt, in the Hermes format the answer is then read in:

    You can call functions to help with the answer. Their signatures, one JSON object each:
    <tools>
    {"type": "function", "function": {"name": ..., "description": ..., "parameters": {...}}}
    </tools>
    To call a function, answer with one block per call:
    <tool_call>
    {"name": <the function's name>, "arguments": <its arguments as a JSON object>}
    </tool_call>

and the history in the same words: an assistant's calls as those blocks, a tool's answer as a user turn
`<tool_response>...</tool_response>`.
"""

from __future__ import annotations

import json
from typing import Any

from handlers.tool_calls import HERMES_CLOSE, HERMES_OPEN

Message = dict[str, Any]


def template_format(template: str | None) -> str:
    """How a model whose chat template is `template` writes a call: "llama3_json" or "hermes"."""
    if template and "tools" in template and ("<|python_tag|>" in template or "<|eot_id|>" in template):
        return "llama3_json"
    return "hermes"


def takes_tools(template: str | None) -> bool:
    return bool(template) and "tools" in template


def render_tools(messages: list[Message], tools: list[dict[str, Any]] | None,
                 template: str | None) -> tuple[list[Message], list[dict[str, Any]] | None]:
    """The messages, and the tools to hand the template (None: it gets them through the messages)."""
    if takes_tools(template):
        return messages, tools or None
    if not tools and not any(m.get("tool_calls") or m["role"] == "tool" for m in messages):
        return messages, None
    out = [_plain(m) for m in messages]
    if tools:
        prompt = _tools_prompt(tools)
        if out and out[0]["role"] == "system":
            out[0] = {"role": "system", "content": f"{out[0]['content']}\n\n{prompt}"}
        else:
            out.insert(0, {"role": "system", "content": prompt})
    return out, None


def _plain(message: Message) -> Message:
    """A message in roles and text any template renders."""
    content = message.get("content") or ""
    if message["role"] == "tool":
        return {"role": "user", "content": f"<tool_response>\n{content}\n</tool_response>"}
    calls = message.get("tool_calls")
    if calls:
        calls_json = [json.dumps({"name": c["function"]["name"], "arguments": c["function"]["arguments"]})
                      for c in calls]
        blocks = [f"{HERMES_OPEN}\n{call}\n{HERMES_CLOSE}" for call in calls_json]
        content = "\n".join(([content] if content else []) + blocks)
    return {"role": message["role"], "content": content}


def _tools_prompt(tools: list[dict[str, Any]]) -> str:
    signatures = "\n".join(json.dumps({"type": "function", "function": t["function"]}) for t in tools)
    return ("You can call functions to help with the answer. Their signatures, one JSON object each:\n"
            f"<tools>\n{signatures}\n</tools>\n"
            "To call a function, answer with one block per call:\n"
            f"{HERMES_OPEN}\n"
            '{"name": <the function\'s name>, "arguments": <its arguments as a JSON object>}\n'
            f"{HERMES_CLOSE}")
