"""`faas-bench coldstart`: one fresh process per mode and repetition, spawn -> first token, with the
server's own stage timeline. Modes are interleaved across repetitions, so drift (thermal, page cache,
other load) falls on every mode alike; from a dropped page cache, the reference read of the disk
(runtime/bench/disk_read.py) is a turn of each round too."""

from __future__ import annotations

import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import httpx

from runtime.bench import BenchError
from runtime.bench.client import stream_completion
from runtime.bench.disk_read import DiskRead, bytes_read_from_disks
from runtime.bench.hf_baseline import run_baseline, unavailable_reason
from runtime.bench.instance import SOURCE_ROOT, Instance, ModeUnavailable, child_environment
from runtime.bench.page_cache import drop_page_cache, warm_page_cache
from runtime.bench.prompt import PromptMaker
from runtime.bench.records import BASELINE_MODE, ModeResult, StartRun, stages_from_durations
from runtime.logs import get_logger

log = get_logger("bench")


@dataclass(frozen=True)
class ColdStartPlan:
    model: str | None
    modes: tuple[str, ...]
    repeat: int
    page_cache: str  # "warm" or "dropped"
    #: the server's settings, as environment variables (MODEL, DEVICE, SNAPSHOT_DIR...)
    settings: dict[str, str]
    log_dir: Path
    prompt_tokens: int = 161
    max_tokens: int = 4
    timeout_s: float = 900.0
    baseline_model: str | None = None  # what transformers loads (None: model)


async def run_coldstart(plan: ColdStartPlan, reference: DiskRead | None = None) -> list[ModeResult]:
    """Every mode's starts, in rounds. REFERENCE, from a dropped page cache: read once more before each round's
    starts, each of which is held against that round's fastest read (`StartRun.reference_read_s`)."""
    results = {mode: ModeResult(mode) for mode in plan.modes}
    prompt = PromptMaker(plan.model).prompt(plan.prompt_tokens)
    if BASELINE_MODE in results:
        reason = unavailable_reason(plan.baseline_model or plan.model) or (
            None if isinstance(prompt, list) else "the model directory has no tokenizer.json")
        if reason:
            results[BASELINE_MODE] = ModeResult(BASELINE_MODE, "skipped", reason)
    if plan.page_cache == "warm":
        _warm_up(plan)
    async with httpx.AsyncClient() as client:
        for rep in range(plan.repeat):
            round_reference = None
            if reference is not None and plan.page_cache == "dropped":
                round_reference = _read_reference(reference, rep, plan)
                if round_reference is None:  # it cannot be read: not this round, nor the next
                    reference = None
            for mode, result in results.items():
                if result.status != "ok":  # skipped or failed once: the reason will not change
                    continue
                page_cache = _prepare_page_cache(plan.page_cache)
                log.info("coldstart: %s, run %d/%d (page cache %s)", mode, rep + 1, plan.repeat, page_cache)
                log_path = plan.log_dir / f"{mode}-{rep + 1}.log"
                read_before = bytes_read_from_disks()
                try:
                    if mode == BASELINE_MODE:
                        run = await run_baseline(plan.baseline_model or plan.model,
                                                 plan.settings.get("DEVICE", "auto"),
                                                 plan.settings.get("DTYPE", "auto"), prompt, page_cache,
                                                 log_path, plan.timeout_s)
                    else:
                        run = await _start_server_once(client, plan, mode, prompt, page_cache, log_path,
                                                       read_before)
                except ModeUnavailable as why:
                    results[mode] = ModeResult(mode, "skipped", str(why))
                except BenchError as exc:
                    results[mode] = ModeResult(mode, "failed", str(exc), result.runs)
                else:
                    run.disk_read_bytes = _read_since(read_before)
                    run.reference_read_s = round_reference
                    result.runs.append(run)
    return list(results.values())


async def _start_server_once(client: httpx.AsyncClient, plan: ColdStartPlan, mode: str, prompt, page_cache: str,
                             log_path: Path, read_before: int | None) -> StartRun:
    """Raises ModeUnavailable when the server took another path than `mode`. READ_BEFORE: the disks' count at
    the spawn, for what the start read until its answer (its shutdown reads more)."""
    instance = Instance.spawn(mode, plan.settings, log_path)
    try:
        await instance.wait_ready(client, plan.timeout_s)
        instance.check_restore_path()
        timing = await stream_completion(client, instance.url, prompt, plan.max_tokens, plan.timeout_s,
                                          every_token=True)
        if not timing.ok:
            raise BenchError(f"the {mode} server's first request failed: {timing.error}")
        read_to_answer = _read_since(read_before)
        health = await instance.fetch_health(client)  # now with the first_token stage
    finally:
        await instance.stop()
    stages = health.get("stages") or stages_from_durations(health.get("timeline", {}))
    return StartRun(mode=mode, restore_path=mode, spawn_to_ready_s=round(instance.ready_at - instance.spawned_at, 6),
                    spawn_to_first_token_s=round(timing.first_token_at - instance.spawned_at, 6), stages=stages,
                    prompt_tokens=timing.prompt_tokens, page_cache=page_cache,
                    disk_read_to_answer_bytes=read_to_answer)


def _read_reference(reference: DiskRead, rep: int, plan: ColdStartPlan) -> float | None:
    """This round's fastest read of REFERENCE, made now; None where it cannot be made (and why, logged)."""
    log.info("coldstart: the reference read, run %d/%d (%s threads)", rep + 1, plan.repeat,
             ", ".join(map(str, reference.thread_counts)))
    why_not = reference.read_once()
    if why_not:
        log.warning("%s: no reference read", why_not)
        return None
    return round(reference.latest_best_s(), 4)


def _read_since(before: int | None) -> int | None:
    """Bytes the machine's disks read since their count was BEFORE; None where either count is unknown."""
    now = bytes_read_from_disks()
    return None if before is None or now is None else now - before


def _prepare_page_cache(wanted: str) -> str:
    if wanted != "dropped":
        return "warm"
    why_not = drop_page_cache()
    if why_not:
        log.warning("%s: this run starts with a warm page cache", why_not)
        return f"warm ({why_not})"
    return "dropped"


def _warm_up(plan: ColdStartPlan) -> None:
    """Bring the model, the snapshots, the directory transformers loads (when it runs) and the Python libraries
    into the page cache, so that the first run is as warm as the others. The libraries are every file the
    starts' interpreter imports from (its sys.path, but not the checkout, whose modules the import below reads): an
    import reads only the pages it touches, and each mode touches others later (after `import torch` alone, the
    first transformers start read 0.2 GiB of them, on the GPU machine and on the CPU one)."""
    baseline = plan.baseline_model if BASELINE_MODE in plan.modes else None
    paths = [Path(p).expanduser() for p in (plan.model, plan.settings.get("SNAPSHOT_DIR"), baseline) if p]
    env = child_environment({}, 0.0)
    warm_page_cache([p for p in paths if p.exists() and not str(p).startswith("s3:")] + _import_roots(env))
    subprocess.run([sys.executable, "-c", "import torch, runtime.launch"], env=env,
                   check=False, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def _import_roots(env: dict[str, str]) -> list[Path]:
    """The directories an interpreter started with ENV imports from (sys.path), but this checkout and the
    directories around it (which may hold much else; a virtual environment inside it is one of the
    directories)."""
    done = subprocess.run([sys.executable, "-c", "import sys; print(*sys.path, sep='\\n')"], env=env,
                          capture_output=True, text=True, check=False)
    roots = {Path(p).resolve() for p in done.stdout.splitlines() if p}
    return sorted(p for p in roots if p.is_dir() and not SOURCE_ROOT.is_relative_to(p))
