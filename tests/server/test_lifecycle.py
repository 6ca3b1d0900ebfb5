"""The process around the app: bad settings, SIGTERM draining, a custom handler named by HANDLER."""

from __future__ import annotations

import shutil
import signal
import subprocess
import threading
import time

import httpx
import orjson
import pytest

from runtime.bench.instance import entry_command
from tests.server.conftest import API_KEY, REPO, bootstrap_command, server_env, start_server


@pytest.mark.parametrize("argv, env, message", [
    (["--port", "http"], {}, "--port='http': must be a valid port"),
    ([], {"DEVICE": "tpu"}, "DEVICE='tpu': must be one of auto, cpu, cuda"),
    (["--model", "/no/such/model"], {}, "MODEL='/no/such/model': no such file or directory"),
    ([], {"HANDLER": "no_such_module:handler"}, "HANDLER='no_such_module:handler': cannot import"),
    (["--flag-that-does-not-exist", "1"], {}, "unknown argument"),
    ([], {"S3_PART_MB": "0"}, "S3_PART_MB='0': must be a positive number"),
    ([], {"CACHE_MAX_GB": "0"}, "CACHE_MAX_GB='0': must be a positive number"),
    ([], {"GPU_MEMORY_UTILIZATION": "nan"}, "GPU_MEMORY_UTILIZATION='nan': must be in (0, 1]"),
    ([], {"SHUTDOWN_GRACE_S": "-1"}, "SHUTDOWN_GRACE_S='-1': must be a number >= 0"),
    ([], {"MAX_NUM_SEQS": "0"}, "MAX_NUM_SEQS='0': must be a positive integer"),
    ([], {"API_KEY": ""}, "API_KEY='': must not be empty"),
    (["--api-key", " "], {}, "--api-key=' ': must not be empty"),
])
def test_bad_settings_fail_fast_with_one_line(argv, env, message):
    r = subprocess.run(bootstrap_command() + argv, cwd=REPO, env=server_env(**env), capture_output=True,
                       text=True, timeout=30)
    assert r.returncode == 2
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and message in lines[0] and lines[0].startswith("faas-bootstrap: ")


def test_help_lists_every_setting():
    r = subprocess.run(bootstrap_command() + ["--help"], cwd=REPO, env=server_env(), capture_output=True,
                       text=True, timeout=30)
    assert r.returncode == 0
    for env in ("MODEL", "PORT", "DEVICE", "SNAPSHOT_DIR", "CACHE_DIR", "API_KEY", "MAX_MODEL_LEN",
                "MAX_NUM_SEQS", "HANDLER", "LOG_LEVEL", "SHUTDOWN_GRACE_S", "LAMBDA_INVOKE_MODE"):
        assert f"[env {env}]" in r.stdout


def test_sigterm_drains_in_flight_stream_then_exits_0(tiny_model_dir, tmp_path):
    server = start_server(tmp_path, "drain", MODEL=str(tiny_model_dir), SHUTDOWN_GRACE_S="600")
    try:
        server.wait_ready()
        events: list[bytes] = []
        first_event, finished = threading.Event(), threading.Event()

        def stream() -> None:
            body = {"prompt": "drain me", "max_tokens": 1500, "ignore_eos": True, "stream": True,
                    "stream_options": {"include_usage": True}}
            with httpx.stream("POST", f"{server.url}/v1/completions", json=body, timeout=120) as r:
                for line in r.iter_lines():
                    if line:
                        events.append(line.encode())
                        first_event.set()
            finished.set()

        reader = threading.Thread(target=stream)
        reader.start()
        assert first_event.wait(10)
        server.process.send_signal(signal.SIGTERM)
        time.sleep(0.5)
        # While the stream still runs (1500 tokens take seconds even on a fast CPU), the server still listens:
        # health says 503 draining, a new request gets a 503 error object
        health = httpx.get(f"{server.url}/health", timeout=2)
        assert health.status_code == 503 and health.json()["status"] == "draining"
        refused = httpx.post(f"{server.url}/v1/completions", json={"prompt": "late", "max_tokens": 2}, timeout=5)
        assert refused.status_code == 503 and refused.json()["error"]["code"] == "not_ready"
        assert not finished.is_set() and server.process.poll() is None
        reader.join(600)  # a loaded machine may need minutes; the grace period is long enough
        assert finished.is_set() and events[-1] == b"data: [DONE]", server.log()[-3000:]
        chunks = [orjson.loads(e[6:]) for e in events[:-1]]
        assert chunks[-2]["choices"][0]["finish_reason"] == "length"
        assert chunks[-1]["usage"]["completion_tokens"] == 1500  # every token of it, none cut off
        assert server.process.wait(15) == 0
    finally:
        server.stop()
    assert "draining" in server.log()


def test_requests_the_grace_period_cuts_end_with_openai_errors_and_exit_0(tiny_model_dir, tmp_path):
    """SHUTDOWN_GRACE_S runs out with a stream and a plain request in flight: the stream ends with an error
    event, the plain request gets a 503 error object, and the process exits 0 (every time: three rounds)."""
    for round_ in range(3):
        server = start_server(tmp_path, f"cut{round_}", MODEL=str(tiny_model_dir), SHUTDOWN_GRACE_S="1")
        try:
            server.wait_ready()
            results: dict = {}
            long = {"prompt": "cut me", "max_tokens": 4000, "ignore_eos": True}

            def stream() -> None:
                with httpx.stream("POST", f"{server.url}/v1/completions", json=long | {"stream": True},
                                  timeout=60) as r:
                    results["stream"] = [line for line in r.iter_lines() if line]

            def plain() -> None:
                results["plain"] = httpx.post(f"{server.url}/v1/completions", json=long, timeout=60)

            clients = [threading.Thread(target=stream), threading.Thread(target=plain)]
            for c in clients:
                c.start()
            deadline = time.monotonic() + 10
            while httpx.get(f"{server.url}/health").json()["engine"]["running"] < 2:
                assert time.monotonic() < deadline, "the two requests never ran together"
                time.sleep(0.05)
            server.process.send_signal(signal.SIGTERM)
            for c in clients:
                c.join(30)
            last = orjson.loads(results["stream"][-1].removeprefix("data: "))
            assert last["error"]["type"] == "service_unavailable_error" and last["error"]["code"] == "shutting_down"
            assert "data: [DONE]" not in results["stream"]  # it did not finish: it was cut
            plain_answer = results["plain"]
            assert plain_answer.status_code == 503 and plain_answer.json()["error"]["code"] == "shutting_down"
            assert server.process.wait(20) == 0, server.log()
            assert "terminate called" not in server.log()
        finally:
            server.stop()


def test_engine_that_cannot_start_exits_1(tiny_model_dir, tmp_path):
    """A model only found unservable while starting: the server listened (503), then exits non-zero so that
    the platform restarts it and shows the crash, rather than lingering unready."""
    model = tmp_path / "not-a-llama"
    shutil.copytree(tiny_model_dir, model)
    (model / "config.json").write_text('{"architectures": ["GPT2LMHeadModel"]}')
    server = start_server(tmp_path, "broken", MODEL=str(model))
    assert server.process.wait(60) == 1
    assert "the engine failed to start" in server.log() and "GPT2LMHeadModel" in server.log()


def test_context_longer_than_the_model_exits_2_with_one_line(tiny_model_dir, tmp_path):
    """MAX_MODEL_LEN is checked against the model once it is read (after listening): the same one line and
    exit 2 as any other bad setting, no traceback."""
    server = start_server(tmp_path, "too-long", MODEL=str(tiny_model_dir), MAX_MODEL_LEN="100000")
    assert server.process.wait(60) == 2
    lines = [line for line in server.log().splitlines() if line.startswith("faas-bootstrap: ")]
    assert lines == ["faas-bootstrap: MAX_MODEL_LEN=100000: must be at most the model's context, 4096 positions"]
    assert "Traceback" not in server.log()


def test_a_starting_server_listens_and_says_it_is_not_ready(tmp_path):
    """The server listens before the engine is ready; here the embedded GGUF model is still being imported
    into an empty cache, seconds on a CPU. Meanwhile /health answers 503 `starting` (a readiness probe waits)
    and the API a 503 error object; once the engine is ready, both answer 200."""
    server = start_server(tmp_path, "starting", CACHE_DIR=str(tmp_path / "cache"), API_KEY=API_KEY)
    try:
        server.wait_ready(timeout=180)
        health, models = server.early[0], server.early[1]
        assert health.status == 503 and health.body["status"] == "starting" and health.body["restore_path"] is None
        assert models.status == 503 and models.body["error"]["code"] == "not_ready"
        ready = httpx.get(f"{server.url}/v1/models", headers={"Authorization": f"Bearer {API_KEY}"})
        assert ready.status_code == 200 and len(ready.json()["data"]) == 1
    finally:
        server.stop()


def test_custom_handler(tiny_model_dir, tmp_path):
    server = start_server(tmp_path, "custom", MODEL=str(tiny_model_dir),
                          HANDLER="examples.custom_handler.handler:handler")
    try:
        server.wait_ready()
        r = httpx.post(f"{server.url}/generate", json={"prompt": "hello", "max_tokens": 7})
        assert r.status_code == 200
        body = r.json()
        assert body["tokens"] <= 7 and body["finish_reason"] in ("stop", "length") and isinstance(body["text"], str)
        r = httpx.post(f"{server.url}/generate", json={"max_tokens": 7})
        assert r.status_code == 400 and r.json()["error"]["param"] == "prompt"
        # the example keeps the OpenAI routes, and health and metrics are always there
        r = httpx.post(f"{server.url}/v1/completions", json={"prompt": "hello", "max_tokens": 2})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] <= 2
        assert httpx.get(f"{server.url}/health").json()["status"] == "ready"
        assert "thawllm_generated_tokens_total" in httpx.get(f"{server.url}/metrics").text
    finally:
        assert server.stop() == 0


def test_the_image_command_starts_without_site_and_serves(tiny_model_dir, tmp_path):
    """The image's ENTRYPOINT, `python3 -S -m runtime.entry`: the packages outside the standard library (the
    server's, torch) come from site, which the entry point runs itself; a handler in the working directory is
    found as with the script."""
    assert "-S" in entry_command()
    server = start_server(tmp_path, "no-site", command=entry_command(), MODEL=str(tiny_model_dir),
                          HANDLER="examples.custom_handler.handler:handler")
    try:
        server.wait_ready()
        r = httpx.post(f"{server.url}/generate", json={"prompt": "hello", "max_tokens": 7})
        assert r.status_code == 200 and r.json()["tokens"] <= 7
        r = httpx.post(f"{server.url}/v1/completions", json={"prompt": "hello", "max_tokens": 2})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] <= 2
    finally:
        assert server.stop() == 0
    r = subprocess.run(entry_command() + ["--port", "http"], cwd=REPO, env=server_env(), capture_output=True,
                       text=True, timeout=30)
    assert r.returncode == 2 and r.stderr.strip() == "faas-bootstrap: --port='http': must be a valid port"


def test_readme_documents_every_setting():
    from runtime.config import Settings

    readme = (REPO / "README.md").read_text()
    for f in Settings.fields():
        flag = "--" + f.name.replace("_", "-")
        assert f"| `{f.metadata['env']}` | `{flag}` |" in readme, f.metadata["env"]
