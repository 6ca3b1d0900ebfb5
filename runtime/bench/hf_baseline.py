"""The `transformers` mode: a fresh process that loads the model with Hugging Face transformers and
generates one token of the same prompt (runtime/bench/hf_child.py), as a user without thawllm would."""

from __future__ import annotations

import asyncio
import importlib.util
import json
import subprocess
import sys
import time
from pathlib import Path

from runtime import timeline as stages
from runtime.bench import BenchError
from runtime.bench.instance import SOURCE_ROOT, child_environment
from runtime.bench.records import BASELINE_MODE, StartRun


def unavailable_reason(model: str | None) -> str | None:
    """Why the baseline cannot run here, or None."""
    if importlib.util.find_spec("transformers") is None:
        return "transformers is not installed"
    directory = Path(model).expanduser() if model else None
    if directory is None or not (directory / "config.json").is_file():
        return "the model is not a Hugging Face directory (transformers cannot load it)"
    if (directory / "manifest.json").is_file():
        return "the model is a faas-build layout: name its source with --baseline-model"
    return None


async def run_baseline(model: str, device: str, dtype: str, prompt_ids: list[int], page_cache: str,
                       log_path: Path, timeout_s: float) -> StartRun:
    job = json.dumps({"model": str(Path(model).expanduser()), "device": device, "dtype": dtype,
                      "prompt_ids": prompt_ids})
    return await asyncio.to_thread(_run_child, job, page_cache, log_path, timeout_s, len(prompt_ids))


def _run_child(job: str, page_cache: str, log_path: Path, timeout_s: float, prompt_tokens: int) -> StartRun:
    log_path.parent.mkdir(parents=True, exist_ok=True)
    spawned_at = time.time()
    env = child_environment({}, spawned_at)
    with open(log_path, "wb") as log:
        try:
            done = subprocess.run([sys.executable, "-m", "runtime.bench.hf_child"], input=job.encode(),
                                  stdout=subprocess.PIPE, stderr=log, env=env, cwd=SOURCE_ROOT, timeout=timeout_s)
        except subprocess.TimeoutExpired:
            raise BenchError(f"the transformers baseline took over {timeout_s:.0f} s (log: {log_path})") from None
    if done.returncode != 0:
        raise BenchError(f"the transformers baseline exited with {done.returncode} (log: {log_path})")
    timeline = json.loads(done.stdout.decode().strip().splitlines()[-1])
    ends = {s["stage"]: s["end_s"] for s in timeline}
    return StartRun(mode=BASELINE_MODE, restore_path=BASELINE_MODE, spawn_to_ready_s=ends[stages.WEIGHTS],
                    spawn_to_first_token_s=ends[stages.FIRST_TOKEN], stages=timeline,
                    prompt_tokens=prompt_tokens, page_cache=page_cache)
