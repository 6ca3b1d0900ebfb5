"""PROFILE_START: a start's sampled profile, written by the server and read by scripts/read_start_profile.py."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import httpx

from tests.server.conftest import API_KEY, REPO, start_server


def wait_for_stages(folder: Path, timeout: float = 30.0) -> Path:
    """The profile file, once its last line (the timeline's stages) is written."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for path in folder.glob("start-*.jsonl"):
            lines = path.read_text().splitlines()
            if lines and "stages" in json.loads(lines[-1]):
                return path
        time.sleep(0.1)
    raise TimeoutError(f"no finished profile in {folder}: {sorted(folder.iterdir())}")


def test_a_start_writes_its_profile_up_to_the_first_token_and_the_script_prints_it(tiny_model_dir, tmp_path):
    folder = tmp_path / "profiles"
    server = start_server(tmp_path, "profiled", MODEL=str(tiny_model_dir), PROFILE_START=str(folder))
    try:
        server.wait_ready()
        r = httpx.post(f"{server.url}/v1/completions", headers={"Authorization": f"Bearer {API_KEY}"},
                       json={"prompt": "profile me", "max_tokens": 4}, timeout=60)
        assert r.status_code == 200
        path = wait_for_stages(folder)
    finally:
        server.stop()
    records = [json.loads(line) for line in path.read_text().splitlines()]
    stages = {s["stage"]: s for s in records[-1]["stages"]}
    assert {"cuda_init", "weights", "ready", "first_token"} <= set(stages)
    frames = {r["stack"]: r["frames"] for r in records if "frames" in r}
    samples = [s for r in records for s in r.get("samples", ())]
    # the engine's start was sampled in its own thread, in seconds since spawn, and sampling stopped soon
    # after the first token
    start_samples = [at for at, thread, stack in samples
                     if thread.startswith("engine-start") and any("llm_engine.py" in f for f in frames[stack])]
    assert start_samples and 0 < min(start_samples) < stages["ready"]["end_s"]
    assert max(at for at, _, _ in samples) < stages["first_token"]["end_s"] + 1.0

    printed = subprocess.run([sys.executable, "scripts/read_start_profile.py", str(path), "--thread", "engine",
                              "--min-ms", "0"], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert printed.returncode == 0, printed.stderr
    assert "stage first_token" in printed.stdout and "engine-start" in printed.stdout
    assert "weights-reader" not in printed.stdout  # only the threads asked for


def test_a_profile_folder_that_cannot_be_written_is_logged_and_the_server_serves(tiny_model_dir, tmp_path):
    not_a_folder = tmp_path / "a-file"
    not_a_folder.write_text("")
    server = start_server(tmp_path, "unprofiled", MODEL=str(tiny_model_dir), PROFILE_START=str(not_a_folder))
    try:
        server.wait_ready()
    finally:
        server.stop()
    assert f"PROFILE_START={not_a_folder}: cannot write a profile there" in server.log()


def test_the_script_refuses_what_is_not_a_profile_in_one_line(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text("not json\n")
    printed = subprocess.run([sys.executable, "scripts/read_start_profile.py", str(bad)], cwd=REPO,
                             capture_output=True, text=True, timeout=60)
    assert printed.returncode == 2
    assert printed.stderr.startswith("read_start_profile: ") and len(printed.stderr.strip().splitlines()) == 1
