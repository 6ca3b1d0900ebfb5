"""AWS Lambda: the real faas-bootstrap, as a custom runtime, against a Runtime API on loopback."""

from __future__ import annotations

import base64
import json
import shutil
import subprocess

import orjson
import pytest

from tests.server.conftest import REPO, bootstrap_command, server_env
from tests.server.runtime_api import Result, RuntimeAPIServer

PRELUDE_TYPE = "application/vnd.awslambda.http-integration-response"


def http_event(method: str, path: str, body: dict | None = None, base64_body: bool = False) -> dict:
    """A Function URL (payload format 2.0) event."""
    raw = orjson.dumps(body) if body is not None else b""
    return {
        "version": "2.0", "routeKey": "$default", "rawPath": path, "rawQueryString": "",
        "headers": {"content-type": "application/json", "host": "abc.lambda-url.us-east-1.on.aws"},
        "requestContext": {"http": {"method": method, "path": path, "protocol": "HTTP/1.1",
                                    "sourceIp": "203.0.113.9", "userAgent": "test"},
                           "requestId": "r", "domainName": "abc.lambda-url.us-east-1.on.aws"},
        "body": base64.b64encode(raw).decode() if base64_body else raw.decode(),
        "isBase64Encoded": base64_body,
    }


def start_runtime(api: RuntimeAPIServer, tmp_path, name: str, **settings: str) -> subprocess.Popen:
    log = open(tmp_path / f"{name}.log", "wb")
    return subprocess.Popen(bootstrap_command(), cwd=REPO, stdout=log, stderr=subprocess.STDOUT,
                            env=server_env(AWS_LAMBDA_RUNTIME_API=api.address, **settings))


@pytest.fixture(scope="module")
def buffered(tiny_model_dir, tmp_path_factory):
    """Buffered responses; the example custom handler (OpenAI routes + an event function)."""
    with RuntimeAPIServer() as api:
        process = start_runtime(api, tmp_path_factory.mktemp("lambda"), "buffered", MODEL=str(tiny_model_dir),
                                HANDLER="examples.custom_handler.handler:handler")
        yield api
        process.kill()


@pytest.fixture(scope="module")
def streaming(tiny_model_dir, tmp_path_factory):
    """Function URL in RESPONSE_STREAM mode."""
    with RuntimeAPIServer() as api:
        process = start_runtime(api, tmp_path_factory.mktemp("lambda"), "streaming", MODEL=str(tiny_model_dir),
                                LAMBDA_INVOKE_MODE="response_stream", HANDLER="tests.server.failing_handler:handler")
        yield api
        process.kill()


def split_prelude(result: Result) -> tuple[dict, bytes]:
    assert result.kind == "response" and result.streamed
    assert result.headers["transfer-encoding"] == "chunked"
    assert result.headers["content-type"] == PRELUDE_TYPE
    prelude, _, body = result.body.partition(b"\0" * 8)
    return orjson.loads(prelude), body


# -- buffered --------------------------------------------------------------------------------------------------

def test_buffered_chat_completion(buffered: RuntimeAPIServer):
    result = buffered.invoke(http_event("POST", "/v1/chat/completions", {
        "model": "tiny-llama", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 5,
        "temperature": 0, "ignore_eos": True}, base64_body=True))
    assert result.kind == "response" and not result.streamed
    response = result.json()
    assert response["statusCode"] == 200 and response["headers"]["content-type"] == "application/json"
    assert response["isBase64Encoded"] is False
    completion = json.loads(response["body"])
    assert completion["object"] == "chat.completion" and completion["usage"]["completion_tokens"] == 5


def test_buffered_sse_and_errors(buffered: RuntimeAPIServer):
    response = buffered.invoke(http_event("POST", "/v1/completions", {
        "prompt": "abc", "max_tokens": 4, "stream": True})).json()
    assert response["statusCode"] == 200 and response["body"].rstrip().endswith("data: [DONE]")
    response = buffered.invoke(http_event("POST", "/v1/completions", {"prompt": "abc", "max_tokens": -3})).json()
    assert response["statusCode"] == 400 and json.loads(response["body"])["error"]["param"] == "max_tokens"
    response = buffered.invoke(http_event("GET", "/health")).json()
    assert response["statusCode"] == 200 and json.loads(response["body"])["restore_path"] == "cold"


def test_direct_invocation_goes_to_the_event_function(buffered: RuntimeAPIServer):
    result = buffered.invoke({"prompt": "hello", "max_tokens": 3})
    assert result.kind == "response"
    body = result.json()
    assert body["tokens"] <= 3 and isinstance(body["text"], str) and body["request_id"]
    result = buffered.invoke({"no prompt": True})  # the event function raises: an invocation error
    assert result.kind == "error" and result.headers["lambda-runtime-function-error-type"] == "Runtime.HandlerError"
    assert "prompt" in result.json()["errorMessage"]


# -- streaming -------------------------------------------------------------------------------------------------

def test_streamed_chat_completion(streaming: RuntimeAPIServer):
    result = streaming.invoke(http_event("POST", "/v1/chat/completions", {
        "model": "tiny-llama", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 300,
        "temperature": 0, "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}))
    prelude, body = split_prelude(result)
    assert prelude["statusCode"] == 200 and prelude["headers"]["content-type"].startswith("text/event-stream")
    events = [e for e in body.decode().split("\n\n") if e]
    assert events[-1] == "data: [DONE]"
    assert orjson.loads(events[-2][6:])["usage"]["completion_tokens"] == 300
    # streamed as generated: many chunks, spread over the generation (300 tokens take a good part of a
    # second even on a fast CPU), not one buffered body
    assert len(result.chunks) > 100
    assert result.chunks[-1][0] - result.chunks[0][0] > 0.05
    assert not result.trailers.get("lambda-runtime-function-error-type")


def test_streamed_plain_responses_carry_status_in_prelude(streaming: RuntimeAPIServer):
    prelude, body = split_prelude(streaming.invoke(http_event("POST", "/v1/completions", {
        "prompt": "abc", "max_tokens": 3})))
    assert prelude["statusCode"] == 200 and orjson.loads(body)["usage"]["completion_tokens"] <= 3
    prelude, body = split_prelude(streaming.invoke(http_event("POST", "/v1/completions", {
        "model": "gpt-9", "prompt": "abc"})))
    assert prelude["statusCode"] == 404 and orjson.loads(body)["error"]["code"] == "model_not_found"


def test_stream_failing_midway_reports_error_trailers(streaming: RuntimeAPIServer):
    result = streaming.invoke(http_event("GET", "/fail-midway"))
    prelude, body = split_prelude(result)
    assert prelude["statusCode"] == 200 and body == b"data: first\n\n"
    assert result.trailers["lambda-runtime-function-error-type"] == "Runtime.HandlerError"
    assert "disk on fire" in result.trailer_error()["errorMessage"]


def test_non_http_event_without_event_function_is_an_invocation_error(streaming: RuntimeAPIServer):
    result = streaming.invoke({"hello": "world"})
    assert result.kind == "error"
    assert result.headers["lambda-runtime-function-error-type"] == "Runtime.UnsupportedEvent"
    error = result.json()
    assert error["errorType"] == "Runtime.UnsupportedEvent" and "HTTP events" in error["errorMessage"]


# -- init failures ---------------------------------------------------------------------------------------------

def test_init_failure_is_reported_to_the_runtime_api(tiny_model_dir, tmp_path):
    model = tmp_path / "not-a-llama"  # a model the engine cannot serve: found out only while starting
    shutil.copytree(tiny_model_dir, model)
    (model / "config.json").write_text(json.dumps({"architectures": ["GPT2LMHeadModel"]}))
    with RuntimeAPIServer() as api:
        process = start_runtime(api, tmp_path, "init", MODEL=str(model))
        assert process.wait(60) == 1
        (error,) = api.init_errors
    assert error.headers["lambda-runtime-function-error-type"] == "Runtime.InitError"
    body = error.json()
    assert body["errorType"] == "Runtime.InitError" and "GPT2LMHeadModel" in body["errorMessage"]
    assert body["stackTrace"]


def test_bad_settings_are_reported_as_init_error(tmp_path):
    with RuntimeAPIServer() as api:
        process = start_runtime(api, tmp_path, "config", MAX_NUM_SEQS="lots")
        assert process.wait(30) == 2
        (error,) = api.init_errors
    assert error.headers["lambda-runtime-function-error-type"] == "Runtime.ConfigError"
    assert "MAX_NUM_SEQS='lots'" in error.json()["errorMessage"]
