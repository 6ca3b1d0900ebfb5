"""Tables (markdown, in the form docs/benchmarks.md shows them) and JSON files, written atomically."""

from __future__ import annotations

import dataclasses
import os
import shlex
import statistics
from pathlib import Path
from typing import Any

import orjson

from runtime.bench.disk_read import GiB
from runtime.bench.records import ModeResult, StartRun
from runtime.bench.trace import TracePoint
from runtime.timeline import STAGE_ORDER


def spread(values: list[float]) -> dict[str, float]:
    return {"median": round(statistics.median(values), 6), "min": round(min(values), 6),
            "max": round(max(values), 6)}


def stage_seconds(run: StartRun) -> dict[str, float]:
    """stage -> seconds in one run, summed when a stage was recorded more than once."""
    out: dict[str, float] = {}
    for stage in run.stages:
        out[stage["stage"]] = out.get(stage["stage"], 0.0) + stage["seconds"]
    return out


def coldstart_summary(result: ModeResult) -> dict[str, Any]:
    if not result.runs:
        return {}
    per_stage: dict[str, list[float]] = {}
    for run in result.runs:
        for name, seconds in stage_seconds(run).items():
            per_stage.setdefault(name, []).append(seconds)
    read = [r.disk_read_bytes / GiB for r in result.runs if r.disk_read_bytes is not None]
    to_answer = [r.disk_read_to_answer_bytes / GiB for r in result.runs if r.disk_read_to_answer_bytes is not None]
    over = [r.spawn_to_first_token_s / r.reference_read_s for r in result.runs if r.reference_read_s]
    return {"spawn_to_first_token_s": spread([r.spawn_to_first_token_s for r in result.runs]),
            "spawn_to_ready_s": spread([r.spawn_to_ready_s for r in result.runs]),
            **({"over_reference_read": spread(over)} if over else {}),
            **({"disk_read_to_answer_gib": spread(to_answer)} if to_answer else {}),
            **({"disk_read_gib": spread(read)} if read else {}),
            "stages_s": {name: spread(values) for name, values in _in_stage_order(per_stage)}}


def coldstart_table(results: list[ModeResult]) -> str:
    """One row per mode: spawn -> first token (median, min, max), spawn -> ready, each start's spawn -> first
    token over its round's reference read, what the start read from disk until its answer and until its exit
    (runs from a dropped page cache), and each stage's median."""
    summaries = {r.mode: coldstart_summary(r) for r in results}
    stage_names = [name for name, _ in _in_stage_order(
        {name: None for s in summaries.values() for name in s.get("stages_s", {})})]
    read = any(run.page_cache == "dropped" and run.disk_read_bytes is not None for r in results for run in r.runs)
    over = any("over_reference_read" in s for s in summaries.values())
    head = (["mode", "runs", "spawn → first token (s), median", "min", "max", "spawn → ready (s)"]
            + (["over the round's reference read, median (min-max)"] if over else [])
            + (["read to answer (GiB)", "read to exit (GiB)"] if read else []) + stage_names)
    rows = ["| " + " | ".join(head) + " |", "|" + " --- |" * len(head)]
    for result in results:
        s = summaries[result.mode]
        if not s:
            cells = [result.mode, "0", f"{result.status}: {result.reason}"] + [""] * (len(head) - 3)
        else:
            first = s["spawn_to_first_token_s"]
            cells = [result.mode, str(len(result.runs)), f"{first['median']:.3f}", f"{first['min']:.3f}",
                     f"{first['max']:.3f}", f"{s['spawn_to_ready_s']['median']:.3f}"]
            if over:
                ratio = s.get("over_reference_read")
                cells.append(f"{ratio['median']:.3f} ({ratio['min']:.2f}-{ratio['max']:.2f})" if ratio else "")
            if read:
                cells += [f"{s[key]['median']:.2f}" if key in s else "" for key in ("disk_read_to_answer_gib",
                                                                                    "disk_read_gib")]
            cells += [f"{s['stages_s'][n]['median']:.3f}" if n in s["stages_s"] else "" for n in stage_names]
        rows.append("| " + " | ".join(c.replace("|", "/") for c in cells) + " |")
    return "\n".join(rows)


def coldstart_json(results: list[ModeResult], context: dict[str, Any]) -> dict[str, Any]:
    return {**context, "modes": {r.mode: {**dataclasses.asdict(r), "summary": coldstart_summary(r)}
                                 for r in results}}


def trace_table(points: list[TracePoint]) -> str:
    head = ["mode", "rate (req/s)", "requests", "completed", "errors", "p50 TTFT (s)", "p99 TTFT (s)",
            "p50 ITL (ms)", "p99 ITL (ms)", "throughput (req/s)", "output tok/s", "instances started",
            "spawn → ready (s), median"]
    rows = ["| " + " | ".join(head) + " |", "|" + " --- |" * len(head)]
    for p in points:
        if p.status != "ok":
            cells = [p.mode, f"{p.rate:g}", f"{p.status}: {p.reason}"] + [""] * (len(head) - 3)
        else:
            ready = [s.spawn_to_ready_s for s in p.instances if s.spawn_to_ready_s is not None]
            cells = [p.mode, f"{p.rate:g}", str(p.requests), str(p.completed), str(p.error_count),
                     f"{p.ttft_p50_s:.3f}", f"{p.ttft_p99_s:.3f}", _ms(p.itl_p50_s), _ms(p.itl_p99_s),
                     f"{p.throughput_rps:.2f}",
                     f"{p.output_tokens_per_s:.1f}", str(len(p.instances)),
                     f"{statistics.median(ready):.3f}" if ready else ""]
        rows.append("| " + " | ".join(c.replace("|", "/") for c in cells) + " |")
    return "\n".join(rows)


def _ms(seconds: float | None) -> str:
    return "" if seconds is None else f"{seconds * 1000:.1f}"


def provenance(context: dict[str, Any]) -> str:
    """The line that goes above a pasted table: the command, the machine and the date."""
    machine = context["machine"]
    where = ", ".join(machine["gpus"]) or f"no GPU, {machine['cpus']} CPUs"
    command = " ".join(["faas-bench", *map(shlex.quote, context["argv"])])
    return f"`{command}` on {where} ({machine['platform']}), {machine['date_utc']}"


def write_json(path: Path, data: Any) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    tmp.write_bytes(orjson.dumps(data, option=orjson.OPT_INDENT_2))
    tmp.replace(path)


def _in_stage_order(by_stage: dict[str, Any]) -> list[tuple[str, Any]]:
    rank = {name: i for i, name in enumerate(STAGE_ORDER)}
    return sorted(by_stage.items(), key=lambda item: rank.get(item[0], len(rank)))
