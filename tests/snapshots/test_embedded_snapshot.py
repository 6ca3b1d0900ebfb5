"""On a CPU machine: a process snapshot of the runtime serving the embedded SmolLM2
(MODEL unset) is baked, restored by faas-bootstrap and answers exactly as a cold start does."""

from __future__ import annotations

import httpx
import openai
import pytest

from runtime.config import Settings
from runtime.weights.embedded import SERVED_NAME, embedded_model_dir
from tests.server.conftest import API_KEY, start_server

pytestmark = pytest.mark.criu

ENV = {"DEVICE": "cpu", "MAX_MODEL_LEN": "512", "MAX_NUM_SEQS": "4"}
QUESTION = [{"role": "user", "content": "What is the capital of France? Answer in one sentence."}]


def answer(server) -> str:
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key=API_KEY, max_retries=0, timeout=120)
    r = client.chat.completions.create(model=SERVED_NAME, messages=QUESTION, max_tokens=16, temperature=0.0)
    return r.choices[0].message.content


def serve(tmp_path, name: str, **env: str):
    server = start_server(tmp_path, name, API_KEY=API_KEY, **ENV, **env)
    server.wait_ready(timeout=180)
    return server


def test_embedded_model_process_snapshot_answers_like_cold(tmp_path):
    from snapshots.process import bake_process_snapshot

    cache = tmp_path / "cache"
    cold = serve(tmp_path, "cold", CACHE_DIR=str(cache))  # MODEL unset: the embedded SmolLM2
    try:
        cold_answer = answer(cold)
    finally:
        cold.stop()
    assert "Paris" in cold_answer

    settings = Settings.from_env({"CACHE_DIR": str(cache), **ENV})
    bake_process_snapshot(settings, embedded_model_dir(cache), tmp_path / "snapshots")

    restored = serve(tmp_path, "restored", CACHE_DIR=str(cache), SNAPSHOT_DIR=str(tmp_path / "snapshots"))
    try:
        state = httpx.get(f"{restored.url}/health", timeout=5).json()
        assert state["restore_path"] == "process" and "restore" in state["timeline"]
        assert state["model"] == SERVED_NAME
        assert answer(restored) == cold_answer
    finally:
        assert restored.stop() == 0
