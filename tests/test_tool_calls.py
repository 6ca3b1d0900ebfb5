"""Reading tool calls out of a model's answer (Hermes / Qwen and Llama 3 formats), whole and streamed, and
tools through a chat template that takes them."""

import json
import random
import shutil

import pytest

from handlers.tool_calls import ToolCallStream, ToolRequest, read_message
from handlers.tool_prompt import render_tools, template_format
from runtime.engine.tokenizer import Tokenizer

WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}
TIME = {"type": "function", "function": {"name": "get_time"}}
HERMES = ('Let me look.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "note": "a } \\" {"}}\n'
          '</tool_call>\n<tool_call>\n{"arguments": {"zone": "UTC"}, "name": "get_time"}\n</tool_call>')
LLAMA3 = ('{"name": "get_weather", "parameters": {"city": "Oslo", "days": [1, 2]}}; '
          '{"name": "get_time", "parameters": {}}')


def _streamed(tools: ToolRequest, text: str, seed: int) -> tuple[str, list[tuple[str, str]]]:
    """Feed `text` in random pieces; reassemble the deltas as an OpenAI client does."""
    rng = random.Random(seed)
    stream, content, calls = ToolCallStream(tools), "", {}
    at = 0
    while at < len(text):
        step = rng.randint(1, 6)
        delta = stream.feed(text[at:at + step], at + step >= len(text))
        at += step
        content += delta.get("content", "")
        for part in delta.get("tool_calls", []):
            call = calls.setdefault(part["index"], {"name": part["function"].get("name"), "arguments": ""})
            assert "id" not in part or part["id"].startswith("call_")
            call["arguments"] += part["function"]["arguments"]
    return content, [(c["name"], c["arguments"]) for c in calls.values()]


@pytest.mark.parametrize("fmt, text, content", [("hermes", HERMES, "Let me look."), ("llama3_json", LLAMA3, None)])
def test_auto_calls_are_read_whole_and_streamed_alike(fmt, text, content):
    tools = ToolRequest([WEATHER, TIME], "auto", format=fmt)
    message_content, calls = read_message(tools, text)
    assert message_content == content
    got = [(c["function"]["name"], c["function"]["arguments"]) for c in calls]
    assert [name for name, _ in got] == ["get_weather", "get_time"]
    assert all(isinstance(json.loads(arguments), dict) for _, arguments in got)
    assert json.loads(got[0][1])["city"] in ("Paris", "Oslo")
    for seed in range(20):
        streamed_content, streamed_calls = _streamed(tools, text, seed)
        assert streamed_calls == got
        assert streamed_content.strip() == (content or "")


@pytest.mark.parametrize("text", [
    "Just an answer, no <tool_ call here.",
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": </tool_call>',   # cut arguments
    '{"city": "Paris"}',                                                          # no name
])
def test_text_that_is_no_complete_call_stays_content(text):
    tools = ToolRequest([WEATHER], "auto")
    assert read_message(tools, text) == (text, [])


def test_a_partial_tag_is_held_back_until_it_is_known():
    stream = ToolCallStream(ToolRequest([WEATHER], "auto"))
    assert stream.feed("Hi <tool_", False) == {"content": "Hi "}
    assert stream.feed("ca", False) == {}
    assert stream.feed("r", False) == {"content": "<tool_car"}


def test_required_and_named_answers():
    required = ToolRequest([WEATHER, TIME], "required")
    _, calls = read_message(required, '[{"name": "get_time", "arguments": {}}, {"name": "get_weather", '
                                      '"arguments": {"city": "Lima"}}]')
    assert [(c["function"]["name"], c["function"]["arguments"]) for c in calls] == [
        ("get_time", "{}"), ("get_weather", '{"city": "Lima"}')]
    named = ToolRequest([WEATHER, TIME], "get_weather")
    _, calls = read_message(named, '{"city": "Lima"}')
    assert calls[0]["function"] == {"name": "get_weather", "arguments": '{"city": "Lima"}'}
    grammar = json.loads(required.grammar().source)
    assert grammar["minItems"] == 1 and "maxItems" not in grammar
    assert json.loads(ToolRequest([WEATHER], "required", parallel=False).grammar().source)["maxItems"] == 1


TEMPLATE_WITH_TOOLS = (
    "{% if tools %}<tools>{% for t in tools %}{{ t | tojson }}{% endfor %}</tools>{% endif %}"
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{% if m.tool_calls %}{% for c in m.tool_calls %}"
    "<tool_call>{{ c.function | tojson }}</tool_call>{% endfor %}{% else %}{{ m.content }}{% endif %}<|im_end|>\n"
    "{% endfor %}")


def test_a_template_that_takes_tools_gets_them_and_the_calls_as_objects(tiny_model, tmp_path):
    model_dir = tmp_path / "model"
    shutil.copytree(tiny_model("tiny-llama"), model_dir)
    (model_dir / "chat_template.jinja").write_text(TEMPLATE_WITH_TOOLS)
    tokenizer = Tokenizer(model_dir)
    assert template_format(tokenizer.chat_template) == "hermes"
    history = [{"role": "user", "content": "Weather?"},
               {"role": "assistant", "content": "", "tool_calls": [
                   {"id": "call_1", "type": "function", "function": {"name": "get_weather",
                                                                      "arguments": {"city": "Paris"}}}]},
               {"role": "tool", "content": "21 C", "tool_call_id": "call_1"}]
    messages, tools = render_tools(history, [WEATHER], tokenizer.chat_template)
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=False, tools=tools)
    assert '<tools>{"type": "function", "function": {"name": "get_weather"' in text
    assert '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>' in text
    assert "<|im_start|>tool\n21 C" in text
    assert template_format("{% if tools %}{% endif %}<|start_header_id|>ipython<|eot_id|>") == "llama3_json"
