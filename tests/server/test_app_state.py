"""The app before and after the engine: what a probe and a client see in each phase (in process)."""

from __future__ import annotations

import subprocess
import sys

import pytest
from starlette.testclient import TestClient

from handlers import health, openai
from runtime.server.app import build_app
from runtime.server.state import AppState
from runtime.timeline import Timeline
from tests.server.conftest import REPO

CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}


@pytest.fixture
def unready():
    state = AppState(Timeline(), model_name="m")
    with TestClient(build_app(state, [health.handler, openai.handler])) as client:
        yield state, client


def test_starting_answers_503_everywhere_but_metrics(unready):
    state, client = unready
    r = client.get("/health")
    assert r.status_code == 503 and r.json()["status"] == "starting" and r.json()["restore_path"] is None
    for method, path in (("POST", "/v1/chat/completions"), ("POST", "/v1/completions"), ("GET", "/v1/models")):
        r = client.request(method, path, json=CHAT)
        assert r.status_code == 503 and r.headers["retry-after"] == "1"
        assert r.json()["error"] == {"message": "the model is still loading", "type": "service_unavailable_error",
                                     "param": None, "code": "not_ready"}
    r = client.get("/metrics")
    assert r.status_code == 200 and "thawllm_ready 0.0" in r.text


def test_failed_and_draining_are_503_with_the_reason(unready):
    state, client = unready
    state.begin_drain()
    assert client.get("/health").json()["status"] == "draining"
    error = client.post("/v1/completions", json={"prompt": "x"}).json()["error"]
    assert error["message"] == "the server is shutting down"
    state.mark_failed("UnsupportedModel: architecture 'X' is not supported")
    h = client.get("/health")
    assert h.status_code == 503 and h.json()["status"] == "failed" and "architecture" in h.json()["error"]
    assert client.post("/v1/completions", json={"prompt": "x"}).json()["error"]["code"] == "engine_failed"


def test_api_key_is_checked_before_readiness():
    state = AppState(Timeline())
    with TestClient(build_app(state, [health.handler, openai.handler], api_key="k")) as client:
        assert client.get("/v1/models").status_code == 401
        assert client.get("/v1/models", headers={"Authorization": "Bearer k"}).status_code == 503
        assert client.get("/health").status_code == 503


def test_nothing_on_the_way_to_listening_imports_torch():
    """Cold-start discipline: the server answers /health while torch is still importing elsewhere."""
    code = ("import sys, runtime.bootstrap, runtime.server.app, runtime.server.serve, handlers.openai, "
            "handlers.health; bad = [m for m in ('torch', 'boto3', 'runtime.server.lambda_runtime') "
            "if m in sys.modules]; print(bad); sys.exit(1 if bad else 0)")
    r = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr


def test_the_first_streamed_response_of_a_process_imports_nothing():
    """Starlette streams inside an anyio task group, and anyio imports its asyncio backend on first use: left
    to the first request, that import delayed the first streamed token by 40 ms here and 0.1 s on the H100
    machine. The app is built with it loaded."""
    code = """
import asyncio, sys
from handlers import health
from runtime.server.app import build_app
from runtime.server.sse import EventStreamResponse, event
from runtime.server.state import AppState
from runtime.timeline import Timeline

build_app(AppState(Timeline()), [health.handler])

async def events():
    yield event({"n": 1})

async def stream():
    sent, messages = [], [{"type": "http.request", "body": b"", "more_body": False}]
    async def receive():
        return messages.pop() if messages else await asyncio.Event().wait()
    async def send(message):
        sent.append(message)
    await EventStreamResponse(events())({"type": "http", "asgi": {"spec_version": "2.3"}}, receive, send)
    return sent

before = set(sys.modules)
sent = asyncio.run(stream())
assert any(m.get("body", b"").startswith(b"data: ") for m in sent), sent
new = sorted(set(sys.modules) - before)
print(new)
sys.exit(1 if new else 0)
"""
    r = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr
