"""Fixtures that run the real `faas-bootstrap` in a subprocess, on a loopback port, against a tiny model."""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import openai
import pytest

REPO = Path(__file__).resolve().parents[2]
API_KEY = "test-key"


def bootstrap_command() -> list[str]:
    """The installed console script, run by this interpreter, importing this checkout (PYTHONPATH); where
    the package is not installed (the GPU machine), the same entry point as a module."""
    script = Path(sys.executable).parent / "faas-bootstrap"
    return [sys.executable, str(script)] if script.exists() else [sys.executable, "-m", "runtime.entry"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def server_env(**settings: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("AWS_LAMBDA_RUNTIME_API", "API_KEY", "HANDLER")}
    pythonpath = os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))
    env.update({"PYTHONPATH": pythonpath, "HOST": "127.0.0.1", "DEVICE": "cpu", "LOG_LEVEL": "info", **settings})
    return env


@dataclass
class Probe:
    path: str
    status: int
    body: dict


@dataclass
class Server:
    process: subprocess.Popen
    port: int
    log_path: Path
    early: list[Probe] = field(default_factory=list)  # answers seen before the first 200 from /health

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def wait_ready(self, timeout: float = 60.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"server exited with {self.process.returncode}:\n{self.log()}")
            try:
                r = httpx.get(f"{self.url}/health", timeout=2)
            except httpx.TransportError:
                time.sleep(0.05)
                continue
            if r.status_code == 200:
                return
            self.early.append(Probe("/health", r.status_code, r.json()))
            if len(self.early) == 1:  # while starting, the API answers too: with a 503 error object
                try:
                    m = httpx.get(f"{self.url}/v1/models", headers={"Authorization": f"Bearer {API_KEY}"},
                                  timeout=2)
                except httpx.TransportError:  # a start that keeps the CPU busy: asked again on the next round
                    self.early.pop()
                    continue
                self.early.append(Probe("/v1/models", m.status_code, m.json()))
            time.sleep(0.05)
        raise TimeoutError(f"server not ready after {timeout} s:\n{self.log()}")

    def stop(self) -> int:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.process.kill()
        return self.process.wait()


def start_server(tmp: Path, name: str, command: list[str] | None = None, **settings: str) -> Server:
    """COMMAND: how faas-bootstrap is started (default: `bootstrap_command()`)."""
    port = free_port()
    log_path = tmp / f"{name}.log"
    with open(log_path, "wb") as log:
        process = subprocess.Popen(command or bootstrap_command(), cwd=REPO, env=server_env(PORT=str(port), **settings),
                                   stdout=log, stderr=subprocess.STDOUT)
    return Server(process, port, log_path)


#: ChatML, so that chat requests have a template to go through (the tiny test model has none)
CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


@pytest.fixture(scope="session")
def tiny_model_dir(tiny_model, tmp_path_factory) -> Path:
    """The shared tiny random Llama (tests/conftest.py), served as `tiny-llama`, with a chat template,
    a 4096-position context, so that a generation can outlast a disconnect by seconds, and its tokenizer's
    <|endoftext|> (id 0) as EOS (transformers' default config names id 2, which this tokenizer spells `"`)."""
    served = tmp_path_factory.mktemp("served") / "tiny-llama"
    shutil.copytree(tiny_model("tiny-llama"), served)
    config = json.loads((served / "config.json").read_text())
    (served / "config.json").write_text(json.dumps(config | {"max_position_embeddings": 4096, "eos_token_id": 0}))
    generation = json.loads((served / "generation_config.json").read_text())
    (served / "generation_config.json").write_text(json.dumps(generation | {"eos_token_id": 0}))
    tokenizer_config = json.loads((served / "tokenizer_config.json").read_text())
    (served / "tokenizer_config.json").write_text(json.dumps(tokenizer_config | {"chat_template": CHATML}))
    return served


@pytest.fixture(scope="session")
def server(tiny_model_dir, tmp_path_factory):
    """The default handler with an API key, as a Knative user would run it."""
    srv = start_server(tmp_path_factory.mktemp("server"), "main", MODEL=str(tiny_model_dir), API_KEY=API_KEY,
                       MAX_MODEL_LEN="2048", MAX_NUM_SEQS="16")
    try:
        srv.wait_ready()
        yield srv
    finally:
        srv.stop()


@pytest.fixture
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=API_KEY, max_retries=0, timeout=60)


@pytest.fixture
def http(server):
    with httpx.Client(base_url=server.url, headers={"Authorization": f"Bearer {API_KEY}"}, timeout=60) as c:
        yield c
