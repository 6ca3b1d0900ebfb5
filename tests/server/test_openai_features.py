"""Structured outputs, tool calls, n, logit_bias, min_tokens, stop_token_ids, echo, /tokenize, /detokenize,
/version and vLLM's metric names, through the real server and the real `openai` client."""

from __future__ import annotations

import json
import re
from typing import Literal

import httpx
import jsonschema
import openai
import pytest
from pydantic import BaseModel, Field

from tests.server.conftest import API_KEY, start_server
from tests.server.test_openai_api import CHAT, GREEDY, metrics

MODEL = "tiny-llama"
EOS = 0  # the served tiny model's <|endoftext|> (tests/server/conftest.py)

#: nested objects, arrays and enums, bounded so that a random model finishes it within max_tokens
SCHEMA = {
    "type": "object", "additionalProperties": False, "required": ["name", "kind", "tags", "owner"],
    "properties": {
        "name": {"type": "string", "maxLength": 6},
        "kind": {"enum": ["cat", "dog", 7, None]},
        "tags": {"type": "array", "maxItems": 3, "items": {"type": "string", "enum": ["a", "bb", "ccc"]}},
        "owner": {"type": "object", "additionalProperties": False, "required": ["age", "admin"],
                  "properties": {"age": {"type": "integer", "minimum": 0, "maximum": 120},
                                 "admin": {"type": "boolean"}}},
    },
}
JSON_SCHEMA = {"type": "json_schema", "json_schema": {"name": "pet", "schema": SCHEMA, "strict": True}}
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "additionalProperties": False, "required": ["city", "unit"],
                   "properties": {"city": {"enum": ["Paris", "Oslo", "Lima"]},
                                  "unit": {"enum": ["celsius", "fahrenheit"]}}}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "parameters": {"type": "object", "additionalProperties": False, "required": ["zone"],
                                       "properties": {"zone": {"enum": ["UTC", "CET"]}}}}}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def server(tiny_model_dir, tmp_path_factory):
    """The default handler on the tiny model, with one intra-op thread: these tests generate a few thousand
    tokens, and on a loaded machine each of torch's parallel regions waits for a second core (ten times
    slower steps at a load of 11 on 2 cores)."""
    srv = start_server(tmp_path_factory.mktemp("features"), "features", MODEL=str(tiny_model_dir), API_KEY=API_KEY,
                       MAX_MODEL_LEN="2048", MAX_NUM_SEQS="16", OMP_NUM_THREADS="1")
    try:
        srv.wait_ready()
        yield srv
    finally:
        srv.stop()


def test_json_schema_output_always_validates(client: openai.OpenAI):
    """24 seeded samples, in two requests of n=12, and 6 streamed ones: every one parses and validates."""
    client = client.with_options(timeout=300)  # some 90 steps a request: a second, a minute on a loaded machine
    outputs = []
    for seed in (1, 100):
        r = client.chat.completions.create(model=MODEL, messages=CHAT, response_format=JSON_SCHEMA, n=12, seed=seed,
                                           temperature=1.0, max_tokens=200)
        assert len(r.choices) == 12
        outputs += [(c.message.content, c.finish_reason) for c in r.choices]
    chunks = list(client.chat.completions.create(model=MODEL, messages=CHAT, response_format=JSON_SCHEMA, n=6,
                                                 seed=1000, max_tokens=200, stream=True))
    for i in range(6):
        mine = [c.choices[0] for c in chunks if c.choices[0].index == i]
        outputs.append(("".join(c.delta.content or "" for c in mine), mine[-1].finish_reason))
    for text, finish_reason in outputs:
        assert finish_reason == "stop", text
        jsonschema.validate(json.loads(text), SCHEMA)
    assert len({text for text, _ in outputs}) > 20  # samples, not one answer repeated


def test_json_object_on_completions_and_a_cut_answer_ends_with_length(client: openai.OpenAI):
    r = client.completions.create(model=MODEL, prompt="A JSON object:", max_tokens=40, seed=3, temperature=0.7,
                                  extra_body={"response_format": {"type": "json_object"}})
    text = r.choices[0].text
    if r.choices[0].finish_reason == "stop":  # a random model may nest objects past any bound
        assert isinstance(json.loads(text), dict)
    else:
        assert r.choices[0].finish_reason == "length" and text.startswith("{")
    cut = client.completions.create(model=MODEL, prompt="A JSON object:", max_tokens=6, seed=3, temperature=0.7,
                                    extra_body={"response_format": {"type": "json_object"}})
    assert cut.choices[0].finish_reason == "length" and isinstance(json.loads(cut.choices[0].text), dict)


#: nested objects, an array and enums, short enough to close: its shortest document is some 30 tokens
CLOSABLE = {
    "type": "object", "additionalProperties": False, "required": ["k", "t", "o"],
    "properties": {
        "k": {"enum": ["a", "b", 1]},
        "t": {"type": "array", "maxItems": 2, "items": {"enum": ["x", "yy"]}},
        "o": {"type": "object", "additionalProperties": False, "required": ["n"],
              "properties": {"n": {"type": "boolean"}, "s": {"type": "string"}}},
    },
}


def _shortest(client: openai.OpenAI, fmt: dict) -> int:
    """The fewest tokens the server says the schema takes, from its 400 for max_tokens=1."""
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model=MODEL, messages=CHAT, response_format=fmt, max_tokens=1)
    assert err.value.body["param"] == "max_tokens"
    return int(re.search(r"takes (\d+) tokens", err.value.body["message"]).group(1))


def test_a_cut_schema_output_is_closed_complete_and_valid(client: openai.OpenAI):
    """From the shortest document's length up, streamed and not and across seeds, every answer parses and
    validates; an answer cut by max_tokens says `length`; one token less than the shortest is a 400."""
    fmt = {"type": "json_schema", "json_schema": {"name": "closable", "schema": CLOSABLE, "strict": True}}
    shortest = _shortest(client, fmt)
    assert 10 < shortest < 60
    with pytest.raises(openai.BadRequestError, match="shortest output"):
        client.chat.completions.create(model=MODEL, messages=CHAT, response_format=fmt, max_tokens=shortest - 1)
    for max_tokens in range(shortest, shortest + 10):
        for seed in (1, 2, 3):
            r = client.chat.completions.create(model=MODEL, messages=CHAT, response_format=fmt, seed=seed,
                                               temperature=1.0, max_tokens=max_tokens)
            choice = r.choices[0]
            jsonschema.validate(json.loads(choice.message.content), CLOSABLE)
            assert r.usage.completion_tokens <= max_tokens
            assert choice.finish_reason == "length" or r.usage.completion_tokens < max_tokens
        chat = list(client.chat.completions.create(model=MODEL, messages=CHAT, response_format=fmt, seed=4,
                                                   max_tokens=max_tokens, stream=True))
        plain = list(client.completions.create(model=MODEL, prompt="A JSON object:", max_tokens=max_tokens, seed=5,
                                               stream=True, extra_body={"response_format": fmt}))
        for text, reasons in (("".join(c.choices[0].delta.content or "" for c in chat),
                               [c.choices[0].finish_reason for c in chat if c.choices[0].finish_reason]),
                              ("".join(c.choices[0].text for c in plain),
                               [c.choices[0].finish_reason for c in plain if c.choices[0].finish_reason])):
            jsonschema.validate(json.loads(text), CLOSABLE)
            assert reasons in (["length"], ["stop"])
    exact = client.chat.completions.create(model=MODEL, messages=CHAT, response_format=fmt, seed=1, max_tokens=shortest)
    assert exact.choices[0].finish_reason == "length" and exact.usage.completion_tokens == shortest


class Owner(BaseModel):
    age: int = Field(ge=0, le=120)
    admin: bool


class Pet(BaseModel):
    name: str = Field(max_length=6)
    kind: Literal["cat", "dog"]
    tags: list[Literal["a", "bb"]] = Field(max_length=2)
    owner: Owner


def test_parse_with_a_pydantic_model(client: openai.OpenAI):
    r = client.chat.completions.parse(model=MODEL, messages=CHAT, response_format=Pet, max_tokens=200, seed=5)
    pet = r.choices[0].message.parsed
    assert isinstance(pet, Pet) and isinstance(pet.owner, Owner) and pet.kind in ("cat", "dog")
    with pytest.raises(openai.BadRequestError, match="max_tokens"):  # shorter than any Pet
        client.chat.completions.parse(model=MODEL, messages=CHAT, response_format=Pet, max_tokens=4, seed=5)


def _arguments_valid(call, tool) -> dict:
    arguments = json.loads(call.function.arguments)
    jsonschema.validate(arguments, tool["function"]["parameters"])
    return arguments


@pytest.mark.parametrize("tool_choice", ["required", {"type": "function", "function": {"name": "get_weather"}}])
def test_tool_call_round_trip(client: openai.OpenAI, http: httpx.Client, tool_choice):
    """The model's call (forced), the tool's answer back, then the model's final answer."""
    first = client.chat.completions.create(model=MODEL, messages=ASK, tools=[WEATHER, TIME], tool_choice=tool_choice,
                                           parallel_tool_calls=False, max_tokens=100, seed=2)
    choice = first.choices[0]
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.id.startswith("call_") and not choice.message.content
    if tool_choice == "required":
        assert call.function.name in ("get_weather", "get_time") and choice.finish_reason == "tool_calls"
    else:
        assert call.function.name == "get_weather" and choice.finish_reason == "stop"
    arguments = _arguments_valid(call, WEATHER if call.function.name == "get_weather" else TIME)

    history = ASK + [choice.message.model_dump(exclude_none=True),
                     {"role": "tool", "tool_call_id": call.id, "content": '{"temperature": 21}'}]
    final = client.chat.completions.create(model=MODEL, messages=history, tools=[WEATHER, TIME], max_tokens=8,
                                           **GREEDY)
    assert final.choices[0].message.content and final.choices[0].finish_reason == "length"
    assert not final.choices[0].message.tool_calls
    # the model saw the tools, its own call and the tool's answer
    prompt = http.post("/tokenize", json={"model": MODEL, "messages": history, "tools": [WEATHER, TIME]}).json()
    assert prompt["count"] == final.usage.prompt_tokens
    text = http.post("/detokenize", json={"model": MODEL, "tokens": prompt["tokens"]}).json()["prompt"]
    assert '"name": "get_time"' in text and "<tool_response>\n{\"temperature\": 21}\n</tool_response>" in text
    assert json.dumps({"name": call.function.name, "arguments": arguments}) in text


def test_streamed_tool_call_deltas_reassemble_to_the_same_calls(client: openai.OpenAI):
    kwargs = dict(model=MODEL, messages=ASK, tools=[WEATHER, TIME], tool_choice="required", max_tokens=150, seed=7)
    whole = client.chat.completions.create(**kwargs).choices[0]
    calls: dict[int, dict] = {}
    finish_reasons = []
    for chunk in client.chat.completions.create(stream=True, **kwargs):
        delta = chunk.choices[0].delta
        assert not delta.content
        for part in delta.tool_calls or ():
            call = calls.setdefault(part.index, {"id": part.id, "name": part.function.name, "arguments": ""})
            assert part.id in (None, call["id"]) and part.function.name in (None, call["name"])
            call["arguments"] += part.function.arguments or ""
        finish_reasons.append(chunk.choices[0].finish_reason)
    assert [(c["name"], c["arguments"]) for c in calls.values()] == [
        (c.function.name, c.function.arguments) for c in whole.message.tool_calls]
    assert finish_reasons[-1] == "tool_calls" and whole.finish_reason == "tool_calls"
    assert all(c["id"].startswith("call_") for c in calls.values())


@pytest.mark.parametrize("tool_choice", ["required", {"type": "function", "function": {"name": "get_weather"}}])
def test_a_cut_tool_call_is_closed_with_valid_arguments(client: openai.OpenAI, tool_choice):
    """A required or named tool call that max_tokens cuts is still a whole call with valid arguments, streamed
    and not; below the shortest call, a 400."""
    kwargs = dict(model=MODEL, messages=ASK, tools=[WEATHER, TIME], tool_choice=tool_choice,
                  parallel_tool_calls=False)
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(**kwargs, max_tokens=1)
    assert err.value.body["param"] == "max_tokens" and "'tools'" in err.value.body["message"]
    shortest = int(re.search(r"takes (\d+) tokens", err.value.body["message"]).group(1))
    for max_tokens in range(shortest, shortest + 8):
        choice = client.chat.completions.create(**kwargs, max_tokens=max_tokens, seed=max_tokens).choices[0]
        (call,) = choice.message.tool_calls
        _arguments_valid(call, WEATHER if call.function.name == "get_weather" else TIME)
        assert choice.finish_reason in ("length", "tool_calls" if tool_choice == "required" else "stop")
        chunks = list(client.chat.completions.create(**kwargs, max_tokens=max_tokens, seed=100 + max_tokens,
                                                     stream=True))
        arguments = "".join(tc.function.arguments or "" for c in chunks for tc in c.choices[0].delta.tool_calls or ())
        assert isinstance(json.loads(arguments), dict)
    exact = client.chat.completions.create(**kwargs, max_tokens=shortest, seed=1).choices[0]
    assert exact.finish_reason == "length" and len(exact.message.tool_calls) == 1


def test_auto_tool_choice_answers_in_text_when_the_model_calls_nothing(client: openai.OpenAI):
    r = client.chat.completions.create(model=MODEL, messages=ASK, tools=[WEATHER], max_tokens=6, **GREEDY)
    assert r.choices[0].message.content and r.choices[0].message.tool_calls is None


@pytest.mark.parametrize("tools, tool_choice, param", [
    ([{"type": "function", "function": {"parameters": {}}}], None, "tools[0].function.name"),
    ([WEATHER], {"type": "function", "function": {"name": "launch"}}, "tool_choice"),
    ([WEATHER], "sometimes", "tool_choice"),
    (None, "required", "tool_choice"),
    ([{"type": "function", "function": {"name": "f", "parameters": {"type": "nonsense"}}}], "required", "tools"),
])
def test_bad_tools_are_400(client: openai.OpenAI, tools, tool_choice, param):
    extra = {"tools": tools} if tools else {}
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, messages=ASK, tool_choice=tool_choice, max_tokens=4, **extra)
    assert e.value.status_code == 400 and e.value.param == param


def test_invalid_schema_is_400(client: openai.OpenAI):
    bad = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object", "minProperties": "two"}}}
    for stream in (False, True):
        with pytest.raises(openai.BadRequestError) as e:
            client.chat.completions.create(model=MODEL, messages=CHAT, response_format=bad, max_tokens=4, stream=stream)
        assert e.value.param == "response_format"


def test_n_choices(client: openai.OpenAI):
    greedy = client.chat.completions.create(model=MODEL, messages=CHAT, n=3, max_tokens=12, **GREEDY)
    assert [c.index for c in greedy.choices] == [0, 1, 2]
    assert len({c.message.content for c in greedy.choices}) == 1
    single = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=12, **GREEDY)
    assert greedy.choices[0].message.content == single.choices[0].message.content
    assert greedy.usage.completion_tokens == 36 and greedy.usage.prompt_tokens == single.usage.prompt_tokens
    seeded = client.completions.create(model=MODEL, prompt="Once", n=3, max_tokens=12, seed=11, temperature=1.0,
                                       extra_body={"ignore_eos": True})
    assert len({c.text for c in seeded.choices}) == 3
    # choice i is seeded seed + i: choice 1 of seed 11 is choice 0 of seed 12
    alone = client.completions.create(model=MODEL, prompt="Once", max_tokens=12, seed=12, temperature=1.0,
                                      extra_body={"ignore_eos": True})
    assert alone.choices[0].text == seeded.choices[1].text
    chunks = list(client.completions.create(model=MODEL, prompt="Once", n=3, max_tokens=12, seed=11, temperature=1.0,
                                            stream=True, extra_body={"ignore_eos": True}))
    streamed = ["".join(c.choices[0].text for c in chunks if c.choices[0].index == i) for i in range(3)]
    assert streamed == [c.text for c in seeded.choices]


def test_n_choices_prefill_the_prompt_once(client: openai.OpenAI, http: httpx.Client):
    """Choices 1 and 2 find the first choice's prompt in the prefix cache: all but its last partial block."""
    prompt = [100 + i % 250 for i in range(70)]  # 4 full blocks of 16 and 6 tokens, not asked for before
    before = metrics(http)
    r = client.completions.create(model=MODEL, prompt=prompt, n=3, max_tokens=4, **GREEDY)
    after = metrics(http)
    assert r.usage.prompt_tokens == 70 and r.usage.prompt_tokens_details.cached_tokens == 0
    hits = after["thawllm_prefix_cache_hits_total"] - before["thawllm_prefix_cache_hits_total"]
    assert hits == 2 * 64


def test_logit_bias_bans_and_forces_tokens(client: openai.OpenAI, http: httpx.Client):
    def token_ids(**kwargs) -> list[int]:
        r = client.completions.create(model=MODEL, prompt="The quick brown", max_tokens=10, logprobs=0, **kwargs)
        text = "".join(r.choices[0].logprobs.tokens)
        return http.post("/tokenize", json={"prompt": text, "add_special_tokens": False}).json()["tokens"]

    greedy = token_ids(**GREEDY)
    banned = token_ids(logit_bias={str(greedy[0]): -100}, **GREEDY)
    assert greedy[0] not in banned
    (quick,) = http.post("/tokenize", json={"prompt": " quick", "add_special_tokens": False}).json()["tokens"]
    forced = client.completions.create(model=MODEL, prompt="The quick brown", max_tokens=6, seed=1, temperature=1.0,
                                       logit_bias={str(quick): 100}, extra_body={"ignore_eos": True})
    assert forced.choices[0].text == " quick" * 6


def test_min_tokens_holds_back_eos(client: openai.OpenAI):
    eager = {"temperature": 0.0, "logit_bias": {str(EOS): 100}}  # EOS at once, unless held back
    assert client.completions.create(model=MODEL, prompt="x", max_tokens=20, **eager).usage.completion_tokens == 1
    held = client.completions.create(model=MODEL, prompt="x", max_tokens=20, extra_body={"min_tokens": 5}, **eager)
    assert held.usage.completion_tokens == 6 and held.choices[0].finish_reason == "stop"


def test_stop_token_ids(client: openai.OpenAI, http: httpx.Client):
    full = client.completions.create(model=MODEL, prompt="The quick", max_tokens=12, logprobs=0, **GREEDY).choices[0]
    tokens = full.logprobs.tokens  # each generated token's text; a token that is new and its own tokenization
    ids = [http.post("/tokenize", json={"prompt": t, "add_special_tokens": False}).json()["tokens"] for t in tokens]
    at = next(i for i in range(2, 12) if len(ids[i]) == 1 and tokens[i] not in tokens[:i])
    r = client.completions.create(model=MODEL, prompt="The quick", max_tokens=12, temperature=0.0,
                                  extra_body={"stop_token_ids": ids[at], "ignore_eos": True})
    assert r.choices[0].finish_reason == "stop" and r.usage.completion_tokens == at + 1
    assert full.text.startswith(r.choices[0].text) and len(r.choices[0].text) < len(full.text)


def test_echo_returns_the_prompt(client: openai.OpenAI):
    prompt = "Once upon a time"
    r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=5, echo=True, **GREEDY)
    plain = client.completions.create(model=MODEL, prompt=prompt, max_tokens=5, **GREEDY)
    assert r.choices[0].text == prompt + plain.choices[0].text
    chunks = list(client.completions.create(model=MODEL, prompt=prompt, max_tokens=5, echo=True, stream=True, **GREEDY))
    assert chunks[0].choices[0].text == prompt and "".join(c.choices[0].text for c in chunks) == r.choices[0].text
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=MODEL, prompt=prompt, max_tokens=5, echo=True, logprobs=1)


def test_tokenize_detokenize_and_version(client: openai.OpenAI, http: httpx.Client):
    text = "Hello world, Ünïcödé 日本語"
    r = http.post("/tokenize", json={"model": MODEL, "prompt": text, "return_token_strs": True}).json()
    assert r["count"] == len(r["tokens"]) == len(r["token_strs"]) and r["max_model_len"] == 2048
    assert http.post("/detokenize", json={"model": MODEL, "tokens": r["tokens"]}).json() == {"prompt": text}
    chat = http.post("/tokenize", json={"messages": CHAT}).json()
    served = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=1)
    assert chat["count"] == served.usage.prompt_tokens
    assert http.post("/detokenize", json={"tokens": [10**6]}).status_code == 400
    assert http.post("/tokenize", json={"model": "gpt-9", "prompt": "x"}).status_code == 404
    assert isinstance(http.get("/version").json()["version"], str)


def test_vllm_metric_names(client: openai.OpenAI, http: httpx.Client):
    label = '{model_name=tiny-llama}'
    before = metrics(http)
    client.completions.create(model=MODEL, prompt="abc", max_tokens=4, **GREEDY)
    after = metrics(http)
    for name in ("time_to_first_token_seconds_count", "e2e_request_latency_seconds_count"):
        assert after[f"vllm:{name}{label}"] == before.get(f"vllm:{name}{label}", 0) + 1
    assert after[f"vllm:inter_token_latency_seconds_count{label}"] >= before.get(
        f"vllm:inter_token_latency_seconds_count{label}", 0) + 3
    assert after[f"vllm:generation_tokens_total{label}"] == before.get(f"vllm:generation_tokens_total{label}", 0) + 4
    assert after[f"vllm:prompt_tokens_total{label}"] > before.get(f"vllm:prompt_tokens_total{label}", 0)
    assert after["vllm:request_success_total{finished_reason=length,model_name=tiny-llama}"] >= 1
    for gauge in ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc"):
        assert after[f"vllm:{gauge}{label}"] == 0


def test_vllm_structured_outputs(client: openai.OpenAI):
    """vLLM's structured_outputs and guided_* parameters: a choice, a regex, a GBNF grammar, a JSON schema."""
    choices = client.chat.completions.create(model=MODEL, messages=ASK, n=6, seed=1, max_tokens=20,
                                             extra_body={"structured_outputs": {"choice": ["yes", "no", "né"]}})
    assert {c.message.content for c in choices.choices} <= {"yes", "no", "né"}
    assert all(c.finish_reason == "stop" for c in choices.choices)
    regex = client.completions.create(model=MODEL, prompt="A code:", n=4, seed=2, max_tokens=20,
                                      extra_body={"guided_regex": r"[0-9]{3}-[a-z]{2}"})
    assert all(re.fullmatch(r"[0-9]{3}-[a-z]{2}", c.text) for c in regex.choices)
    gbnf = client.completions.create(model=MODEL, prompt="Answer:", n=4, seed=3, max_tokens=20,
                                     extra_body={"guided_grammar": 'root ::= ("on" | "off") " " [0-9]'})
    assert all(re.fullmatch(r"(on|off) [0-9]", c.text) for c in gbnf.choices)
    schema = client.completions.create(model=MODEL, prompt="Pet:", seed=4, max_tokens=200,
                                       extra_body={"guided_json": SCHEMA})
    jsonschema.validate(json.loads(schema.choices[0].text), SCHEMA)


@pytest.mark.parametrize("extra, pattern", [
    ({"structured_outputs": {"choice": ["maybe", "no", "né"]}}, r"maybe|no|né"),
    ({"guided_regex": r"[a-z]+-[0-9]{2}"}, r"[a-z]+-[0-9]{2}"),
    ({"guided_grammar": 'root ::= ("on" | "off") " " [0-9]+'}, r"(on|off) [0-9]+"),
])
def test_a_cut_regex_choice_or_grammar_output_is_closed(client: openai.OpenAI, extra, pattern):
    with pytest.raises(openai.BadRequestError, match="shortest output") as err:
        client.completions.create(model=MODEL, prompt="x", max_tokens=1, extra_body=extra)
    shortest = int(re.search(r"takes (\d+) tokens", err.value.body["message"]).group(1))
    for max_tokens in range(shortest, shortest + 4):
        r = client.completions.create(model=MODEL, prompt="Answer:", n=3, seed=max_tokens, max_tokens=max_tokens,
                                      extra_body=extra)
        assert all(re.fullmatch(pattern, c.text) for c in r.choices), [c.text for c in r.choices]


@pytest.mark.parametrize("extra, param", [
    ({"guided_regex": "[0-9"}, "guided_regex"),
    ({"guided_grammar": 'root ::= ( "x'}, "guided_grammar"),
    ({"structured_outputs": {"choice": []}}, "structured_outputs"),
    ({"guided_choice": ["a"], "response_format": {"type": "json_object"}}, "guided_choice"),
])
def test_bad_structured_outputs_are_400(client: openai.OpenAI, extra, param):
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=MODEL, prompt="x", max_tokens=4, extra_body=extra)
    assert e.value.param == param
