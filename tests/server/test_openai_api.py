"""The OpenAI-compatible API, through the real server and the real `openai` client."""

from __future__ import annotations

import asyncio
import threading
import time

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.server.conftest import API_KEY

CHAT = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Say something."},
        {"role": "assistant", "content": "Something."}, {"role": "user", "content": "Again."}]
GREEDY = {"temperature": 0.0, "extra_body": {"ignore_eos": True}}


def metrics(http: httpx.Client) -> dict[str, float]:
    """sample name{labels} -> value, from the real /metrics endpoint."""
    out = {}
    for family in text_string_to_metric_families(http.get("/metrics").text):
        for s in family.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()))
            out[f"{s.name}{{{labels}}}" if labels else s.name] = s.value
    return out


def wait_for(predicate, timeout: float = 10.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.05)


# -- happy paths ---------------------------------------------------------------------------------------------

def test_chat_completion(client: openai.OpenAI):
    r = client.chat.completions.create(model="tiny-llama", messages=CHAT, max_tokens=12, **GREEDY)
    assert r.id.startswith("chatcmpl-") and r.object == "chat.completion" and r.model == "tiny-llama"
    assert abs(r.created - time.time()) < 60
    (choice,) = r.choices
    assert choice.message.role == "assistant" and choice.message.content
    assert choice.finish_reason == "length"
    assert r.usage.completion_tokens == 12
    assert r.usage.prompt_tokens > 20  # the whole conversation went through the chat template
    assert r.usage.total_tokens == r.usage.prompt_tokens + 12


def test_chat_stream_matches_non_stream_and_reports_usage(client: openai.OpenAI):
    whole = client.chat.completions.create(model="tiny-llama", messages=CHAT, max_tokens=20, **GREEDY)
    chunks = list(client.chat.completions.create(model="tiny-llama", messages=CHAT, max_tokens=20, stream=True,
                                                 stream_options={"include_usage": True}, **GREEDY))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert len({c.id for c in chunks}) == 1 and chunks[0].object == "chat.completion.chunk"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == ["length"]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 20
    assert chunks[-1].usage.prompt_tokens == whole.usage.prompt_tokens
    assert all(c.usage is None for c in chunks[:-1])


def test_stream_without_usage_option_has_no_usage_chunk(client: openai.OpenAI):
    chunks = list(client.chat.completions.create(model="tiny-llama", messages=CHAT, max_tokens=5, stream=True,
                                                 **GREEDY))
    assert all(c.choices for c in chunks) and all(c.usage is None for c in chunks)


def test_stream_ends_with_done(http: httpx.Client):
    body = {"model": "tiny-llama", "prompt": "abc", "max_tokens": 4, "stream": True}
    with http.stream("POST", "/v1/completions", json=body) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        events = [line for line in r.iter_lines() if line]
    assert events[-1] == "data: [DONE]" and all(e.startswith("data: ") for e in events)


def test_completions(client: openai.OpenAI):
    r = client.completions.create(model="tiny-llama", prompt="Once upon a time", max_tokens=9, **GREEDY)
    assert r.object == "text_completion" and r.id.startswith("cmpl-")
    assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == 9
    stream = list(client.completions.create(model="tiny-llama", prompt="Once upon a time", max_tokens=9,
                                            stream=True, stream_options={"include_usage": True}, **GREEDY))
    assert "".join(c.choices[0].text for c in stream if c.choices) == r.choices[0].text
    assert stream[-1].usage.total_tokens == r.usage.total_tokens


def test_completions_default_max_tokens_is_16(client: openai.OpenAI):
    r = client.completions.create(model="tiny-llama", prompt="x", **GREEDY)
    assert r.usage.completion_tokens == 16


def test_completions_accepts_token_ids(client: openai.OpenAI):
    r = client.completions.create(model="tiny-llama", prompt=[60, 61, 62, 63], max_tokens=3, **GREEDY)
    assert r.usage.prompt_tokens == 4 and r.usage.completion_tokens == 3


def test_stop_string_cuts_the_text(client: openai.OpenAI):
    prompt = "The quick brown fox"
    full = client.completions.create(model="tiny-llama", prompt=prompt, max_tokens=40, **GREEDY).choices[0].text
    # a stop string taken from the middle of what the model says greedily, so it is bound to be hit
    at = next(i for i in range(3, len(full) - 2) if full[i:i + 2].isprintable() and full.find(full[i:i + 2]) == i)
    stop = full[at:at + 2]
    for stream in (False, True):
        r = client.completions.create(model="tiny-llama", prompt=prompt, max_tokens=40, stop=[stop, "\x00zz"],
                                      stream=stream, **GREEDY)
        chunks = list(r) if stream else [r]
        text = "".join(c.choices[0].text for c in chunks)
        assert text == full[:at]
        assert [c.choices[0].finish_reason for c in chunks if c.choices[0].finish_reason] == ["stop"]


def test_seed_makes_sampling_reproducible(client: openai.OpenAI):
    def sample(seed: int) -> str:
        r = client.chat.completions.create(model="tiny-llama", messages=CHAT, max_tokens=24, temperature=1.0,
                                           seed=seed, extra_body={"ignore_eos": True})
        return r.choices[0].message.content

    first = sample(1234)
    assert sample(1234) == first
    assert sample(4321) != first


def test_logprobs(client: openai.OpenAI):
    r = client.chat.completions.create(model="tiny-llama", messages=CHAT, max_tokens=5, logprobs=True,
                                       top_logprobs=3, **GREEDY)
    content = r.choices[0].logprobs.content
    assert len(content) == 5
    for entry in content:
        assert entry.logprob <= 0 and len(entry.top_logprobs) == 3
        # greedy: the chosen token is the most likely one
        assert entry.top_logprobs[0].logprob == pytest.approx(entry.logprob, abs=1e-4)
    assert all(isinstance(e.token, str) and e.bytes is not None for e in content)
    c = client.completions.create(model="tiny-llama", prompt="abc", max_tokens=4, logprobs=2, **GREEDY)
    lp = c.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 4
    assert all(len(top) <= 2 for top in lp.top_logprobs) and lp.text_offset[0] == 0


def test_logprob_bytes_rebuild_the_text(client: openai.OpenAI):
    """Each token's real bytes, parts of multi-byte characters included: joined, they are the text."""
    lone_bytes = 0
    for seed in range(4):
        r = client.chat.completions.create(model="tiny-llama", messages=[{"role": "user", "content": "日本語 🦊"}],
                                           max_tokens=24, logprobs=True, top_logprobs=2, seed=seed,
                                           extra_body={"ignore_eos": True})
        content = r.choices[0].logprobs.content
        decoded = b"".join(bytes(e.bytes) for e in content).decode("utf-8", "replace")
        text = r.choices[0].message.content
        # the text leaves out a broken character at the very end (the length limit cut it), nothing else
        assert decoded == text or (decoded.startswith(text) and decoded.endswith("\ufffd"))
        for e in content:
            assert all(bytes(t.bytes).decode("utf-8", "replace") == t.token for t in e.top_logprobs)
            assert e.bytes != list("\ufffd".encode())  # never the placeholder's bytes for a token's own
            lone_bytes += len(e.bytes) == 1 and e.bytes[0] >= 0x80
    assert lone_bytes  # the case at stake was served: tokens holding a part of a character


def test_models(client: openai.OpenAI, http: httpx.Client):
    (model,) = client.models.list().data
    assert model.id == "tiny-llama" and model.owned_by == "thawllm"
    assert client.models.retrieve("tiny-llama").id == "tiny-llama"
    r = http.get("/v1/models/gpt-4")
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"


def test_extra_parameters_are_accepted(client: openai.OpenAI):
    r = client.chat.completions.create(
        model="tiny-llama", messages=[{"role": "developer", "content": [{"type": "text", "text": "hi"}]}],
        max_completion_tokens=3, top_p=0.9, presence_penalty=0.5, frequency_penalty=0.5, user="someone", n=1,
        extra_body={"top_k": 5})
    assert r.usage.completion_tokens <= 3


# -- errors ----------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("body, param", [
    ({"messages": CHAT, "max_tokens": -1}, "max_tokens"),
    ({"messages": CHAT, "max_completion_tokens": 0}, "max_completion_tokens"),
    ({"messages": CHAT, "temperature": 2.5}, "temperature"),
    ({"messages": CHAT, "temperature": "hot"}, "temperature"),
    ({"messages": CHAT, "top_p": 0}, "top_p"),
    ({"messages": []}, "messages"),
    ({"messages": [{"role": "wizard", "content": "x"}]}, "messages[0].role"),
    ({"messages": CHAT, "n": 0}, "n"),
    ({"messages": CHAT, "echo": True}, "echo"),  # completions only
    ({"messages": CHAT, "logprobs": True, "top_logprobs": 50}, "top_logprobs"),
    ({"messages": CHAT, "stop": 7}, "stop"),
    ({"messages": CHAT, "presence_penalty": 3}, "presence_penalty"),
    ({"messages": [{"role": "user", "content": "x" * 3000}]}, "max_tokens"),  # longer than the context
])
def test_invalid_chat_request_is_400(http: httpx.Client, body, param):
    r = http.post("/v1/chat/completions", json={"model": "tiny-llama", **body})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["type"] == "invalid_request_error" and error["param"] == param and error["message"]


#: what both routes check alike: (parameter, value, code); "unsupported_parameter" where the value is valid
#: but not served, None where it is invalid
SHARED_CHECKS = [
    ("best_of", 2, "unsupported_parameter"),
    ("suffix", "and then", "unsupported_parameter"),
    ("n", 200, None),
    ("logit_bias", {"50": 101}, None),
    ("logit_bias", {"fifty": 1}, None),
    ("logit_bias", {"100000": 1}, None),  # outside the vocabulary
    ("stop_token_ids", [-1], None),
    ("min_tokens", 5, None),  # more than max_tokens
    ("min_p", 1.5, None),
    ("response_format", {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nonsense"}}}, None),
    ("response_format", {"type": "json_schema", "json_schema": {"name": "x", "schema": []}}, None),
    ("response_format", "text", None),
    ("response_format", {"type": "yaml"}, None),
    ("user", 5, None),
    ("max_completion_tokens", "5", None),
    ("max_completion_tokens", -3, None),
    ("max_completion_tokens", 0, None),
    ("max_tokens", "5", None),
]


@pytest.mark.parametrize("route", ["/v1/chat/completions", "/v1/completions"])
@pytest.mark.parametrize("param, value, code", SHARED_CHECKS)
def test_both_routes_validate_parameters_alike(http: httpx.Client, route, param, value, code):
    body = {"messages": CHAT} if route == "/v1/chat/completions" else {"prompt": "hello"}
    r = http.post(route, json={"model": "tiny-llama", "max_tokens": 2, **body, param: value})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert (error["type"], error["param"], error["code"]) == ("invalid_request_error", param, code)
    assert param in error["message"]


def test_valid_shared_parameters_are_served_on_both_routes(client: openai.OpenAI):
    chat = client.chat.completions.create(model="tiny-llama", messages=CHAT, max_completion_tokens=2, user="u",
                                          response_format={"type": "text"}, **GREEDY)
    text = client.completions.create(model="tiny-llama", prompt="hello", user="u", temperature=0.0,
                                     extra_body={"max_completion_tokens": 3, "ignore_eos": True})
    assert (chat.usage.completion_tokens, text.usage.completion_tokens) == (2, 3)


def test_prompt_longer_than_context_is_400_in_the_client(client: openai.OpenAI):
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model="tiny-llama", prompt="y" * 2040, max_tokens=100, stream=True)
    assert "context length" in e.value.message


def test_malformed_json_is_400(http: httpx.Client):
    for content in (b"{not json", b"[1, 2]"):
        r = http.post("/v1/chat/completions", content=content, headers={"Content-Type": "application/json"})
        assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"


def test_unknown_model_is_404(client: openai.OpenAI):
    with pytest.raises(openai.NotFoundError) as e:
        client.chat.completions.create(model="gpt-5", messages=CHAT, max_tokens=2)
    assert e.value.code == "model_not_found"


def test_unknown_route_is_404_error_object(http: httpx.Client):
    r = http.get("/v1/nothing-here")
    assert r.status_code == 404 and r.json()["error"]["code"] == "not_found"
    r = http.get("/v1/chat/completions")
    assert r.status_code == 405 and "error" in r.json()


def test_api_key(server, http: httpx.Client):
    body = {"model": "tiny-llama", "messages": CHAT, "max_tokens": 2}
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": API_KEY}):
        r = httpx.post(f"{server.url}/v1/chat/completions", json=body, headers=headers)
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{server.url}/v1", api_key="nope", max_retries=0).models.list()
    # probes and scrapers need no key
    assert httpx.get(f"{server.url}/health").status_code == 200
    assert httpx.get(f"{server.url}/metrics").status_code == 200


def test_server_keeps_serving_after_bad_requests(client: openai.OpenAI, http: httpx.Client):
    for _ in range(3):
        http.post("/v1/completions", content=b"\xff\xfe garbage")
        http.post("/v1/completions", json={"prompt": "x", "max_tokens": "many"})
    r = client.completions.create(model="tiny-llama", prompt="still there?", max_tokens=3, **GREEDY)
    assert r.usage.completion_tokens == 3


# -- health, readiness, metrics ------------------------------------------------------------------------------

def test_health_reports_the_cold_start(server, http: httpx.Client):
    r = httpx.get(f"{server.url}/health")
    assert r.status_code == 200
    h = r.json()
    assert h["status"] == "ready" and h["model"] == "tiny-llama" and h["restore_path"] == "cold"
    assert set(h["skipped"]) == {"gpu", "process", "materialized"} and all(h["skipped"].values())
    assert h["timeline"]["runtime_init"] > 0 and "weights" in h["timeline"] and "kv_cache" in h["timeline"]
    assert "cold-start timeline" in server.log()  # the table printed at ready


def test_metrics(client: openai.OpenAI, http: httpx.Client):
    before = metrics(http)
    client.chat.completions.create(model="tiny-llama", messages=CHAT, max_tokens=6, **GREEDY)
    after = metrics(http)
    assert after["thawllm_time_to_first_token_seconds_count"] == before["thawllm_time_to_first_token_seconds_count"] + 1
    assert after["thawllm_inter_token_latency_seconds_count"] >= before["thawllm_inter_token_latency_seconds_count"] + 5
    assert after["thawllm_generated_tokens_total"] == before["thawllm_generated_tokens_total"] + 6
    assert after["thawllm_requests_finished_total{finish_reason=length}"] >= 1
    assert after["thawllm_cold_start_stage_seconds{stage=runtime_init}"] > 0
    assert after["thawllm_cold_start_stage_seconds{stage=first_token}"] >= 0
    assert after["thawllm_restore_path{path=cold}"] == 1 and after["thawllm_ready"] == 1
    assert after["thawllm_kv_blocks_total"] > 0
    assert after["thawllm_requests_running"] == 0 and after["thawllm_requests_waiting"] == 0
    # one request of 6 tokens: a prefill, then decode steps launched before the last one's token was read
    steps = {launch: after[f"thawllm_engine_steps_total{{launch={launch}}}"]
             - before[f"thawllm_engine_steps_total{{launch={launch}}}"] for launch in ("ahead", "settled")}
    assert steps["ahead"] >= 3 and steps["ahead"] + steps["settled"] == 6


# -- concurrency and disconnects -----------------------------------------------------------------------------

def test_16_concurrent_streams(server, http: httpx.Client):
    async def one(client: openai.AsyncOpenAI, i: int) -> tuple[str, int]:
        stream = await client.chat.completions.create(
            model="tiny-llama", messages=[{"role": "user", "content": f"stream number {i}"}], max_tokens=32,
            stream=True, stream_options={"include_usage": True}, seed=i, extra_body={"ignore_eos": True})
        text, usage = "", None
        async for chunk in stream:
            if chunk.choices:
                text += chunk.choices[0].delta.content or ""
            usage = chunk.usage or usage
        return text, usage.completion_tokens

    async def all_of_them():
        async with openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key=API_KEY, max_retries=0) as client:
            return await asyncio.gather(*(one(client, i) for i in range(16)))

    results = asyncio.run(all_of_them())
    assert [n for _, n in results] == [32] * 16 and all(text for text, _ in results)
    m = metrics(http)
    assert m["thawllm_kv_blocks_used"] == 0 and m["thawllm_requests_running"] == 0


def _long_generation(stream: bool) -> dict:
    return {"model": "tiny-llama", "prompt": "long", "max_tokens": 1800, "ignore_eos": True, "stream": stream}


def test_client_disconnect_mid_stream_frees_kv_blocks(server, http: httpx.Client):
    with httpx.Client(base_url=server.url, headers={"Authorization": f"Bearer {API_KEY}"}, timeout=60) as other:
        response = other.send(other.build_request("POST", "/v1/completions", json=_long_generation(True)), stream=True)
        lines = response.iter_lines()
        assert next(lines).startswith("data: ")
        m = metrics(http)
        assert m["thawllm_requests_running"] == 1 and m["thawllm_kv_blocks_used"] > 0
        response.close()  # the client goes away ~1800 tokens (seconds) before the end
    wait_for(lambda: metrics(http)["thawllm_kv_blocks_used"] == 0, timeout=3, what="KV blocks to be freed")
    assert metrics(http)["thawllm_requests_running"] == 0


def test_client_disconnect_without_streaming_frees_kv_blocks(server, http: httpx.Client):
    done = threading.Event()

    def impatient_client():
        try:
            with httpx.Client(base_url=server.url, headers={"Authorization": f"Bearer {API_KEY}"}, timeout=1.0) as c:
                c.post("/v1/completions", json=_long_generation(False))
        except httpx.TimeoutException:
            pass  # the client gives up after a second and closes the connection
        done.set()

    threading.Thread(target=impatient_client).start()
    wait_for(lambda: metrics(http)["thawllm_requests_running"] == 1, what="the request to run")
    assert done.wait(5)
    wait_for(lambda: metrics(http)["thawllm_kv_blocks_used"] == 0, timeout=3, what="KV blocks to be freed")
