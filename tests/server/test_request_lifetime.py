"""A request's life in the real server: a client that leaves before its first token gives everything back at
once, a huge prompt does not stop the server answering others, and a body beyond MAX_REQUEST_MB is a 413."""

from __future__ import annotations

import json
import socket
import threading
import time

import httpx
import pytest

from tests.server.conftest import start_server
from tests.server.test_openai_api import metrics, wait_for


@pytest.fixture(scope="module")
def one_at_a_time(tiny_model_dir, tmp_path_factory):
    """One sequence in the batch at a time, so that a second request waits in the queue; bodies up to 1 MiB."""
    srv = start_server(tmp_path_factory.mktemp("lifetime"), "lifetime", MODEL=str(tiny_model_dir),
                       MAX_NUM_SEQS="1", MAX_REQUEST_MB="1")
    try:
        srv.wait_ready()
        yield srv
    finally:
        srv.stop()


def _send_and_hold(port: int, path: str, body: dict) -> socket.socket:
    """A client that sends its request and then only waits (reads nothing) until the test hangs up for it."""
    data = json.dumps(body).encode()
    conn = socket.create_connection(("127.0.0.1", port))
    conn.sendall(f"POST {path} HTTP/1.1\r\nHost: test\r\nContent-Type: application/json\r\n"
                 f"Content-Length: {len(data)}\r\n\r\n".encode() + data)
    return conn


def test_clients_gone_before_their_first_token_leave_the_queue_at_once(one_at_a_time):
    srv = one_at_a_time
    http = httpx.Client(base_url=srv.url, timeout=30)
    long = {"prompt": "busy", "max_tokens": 4000, "ignore_eos": True, "stream": True}
    chat = {"messages": [{"role": "user", "content": "queued"}], "max_tokens": 64}
    with http.stream("POST", "/v1/completions", json=long) as busy:
        lines = busy.iter_lines()
        assert next(lines).startswith("data: ")  # the one batch place is taken for a long while
        held = [_send_and_hold(srv.port, f"/v1/{route}", body) for route, body in [
            ("completions", {"prompt": "queued " * 50, "max_tokens": 64}),
            ("completions", {"prompt": "queued", "max_tokens": 64}),
            ("chat/completions", chat),
            ("chat/completions", chat | {"stream": True}),
            ("completions", {"prompt": "queued", "max_tokens": 64, "stream": True})]]
        wait_for(lambda: metrics(http)["thawllm_requests_waiting"] == 5, timeout=60, what="five requests queued")
        for conn in held:
            conn.setblocking(False)
            with pytest.raises(BlockingIOError):
                conn.recv(1)  # no answer yet, not even headers: none of them has a first token
            conn.close()  # the client goes away
        # gone from the queue within moments, while the request ahead of them still runs
        wait_for(lambda: metrics(http)["thawllm_requests_waiting"] == 0, timeout=5, what="the queue to empty")
        assert metrics(http)["thawllm_requests_running"] == 1
    wait_for(lambda: metrics(http)["thawllm_kv_blocks_used"] == 0, timeout=10, what="KV blocks to be freed")
    # none of them was served after all: every request the server finished was aborted
    assert metrics(http).get("thawllm_requests_finished_total{finish_reason=length}", 0) == 0


def test_health_answers_while_a_huge_prompt_is_tokenised(one_at_a_time):
    srv = one_at_a_time
    # ~0.93 MiB, under the 1 MiB body limit, of one-character words between punctuation: a token for nearly every
    # byte, about twice the tokeniser's time of plain prose of that size (about 0.9 s on a fast machine)
    prompt = "a.b,c;d:e!f?g " * 70000
    result: dict = {}

    def send() -> None:
        result["response"] = httpx.post(f"{srv.url}/v1/completions", json={"prompt": prompt, "max_tokens": 1},
                                        timeout=60)

    sender = threading.Thread(target=send)
    sent = time.monotonic()
    sender.start()
    slowest, probes = 0.0, 0
    while sender.is_alive():
        started = time.monotonic()
        assert httpx.get(f"{srv.url}/health", timeout=5).status_code == 200
        slowest, probes = max(slowest, time.monotonic() - started), probes + 1
        time.sleep(0.02)
    took = time.monotonic() - sent
    # long enough to tell, counted in time: on a loaded machine each probe itself takes a tenth of a second or more
    assert took > 0.5 and probes >= 3, "the prompt was tokenised too fast to tell"
    # tokenised on the event loop, one probe would wait for all of it; off it, none waits for long
    assert slowest < min(1.0, took / 4)
    r = result["response"]
    assert r.status_code == 400 and "maximum context length" in r.json()["error"]["message"]


def test_body_beyond_the_limit_is_413(one_at_a_time):
    srv = one_at_a_time
    big = {"prompt": "x" * (1 << 20), "max_tokens": 1}
    r = httpx.post(f"{srv.url}/v1/completions", json=big, timeout=30)
    assert r.status_code == 413
    error = r.json()["error"]
    assert error["type"] == "invalid_request_error" and error["code"] == "request_too_large"
    assert "MAX_REQUEST_MB" in error["message"]

    def chunked():  # no Content-Length: the limit is found while the body is read
        yield b'{"prompt": "'
        for _ in range(17):
            yield b"y" * 65536
        yield b'", "max_tokens": 1}'

    r = httpx.post(f"{srv.url}/v1/chat/completions", content=chunked(), timeout=30)
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"
    r = httpx.post(f"{srv.url}/v1/completions", json={"prompt": "small", "max_tokens": 2}, timeout=30)
    assert r.status_code == 200  # and the server serves on
