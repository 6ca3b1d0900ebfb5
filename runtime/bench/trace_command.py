"""`faas-bench trace`: every mode at every rate, then the table, trace.json, trace.md and trace.png.

The files are written again after each (mode, rate), so a run stopped part way (a time limit's SIGTERM)
leaves every point it finished."""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
from pathlib import Path
from typing import Any

from runtime.bench import BenchError
from runtime.bench.machine import describe_machine
from runtime.bench.plots import plot_trace, trace_title
from runtime.bench.pool import ScalePolicy, StartRecord
from runtime.bench.prompt import PromptMaker
from runtime.bench.records import VARIANTS
from runtime.bench.report import provenance, trace_table, write_json
from runtime.bench.trace import TracePoint, run_trace_point
from runtime.bench.workload import WorkloadShape, make_workload
from runtime.config import Settings
from runtime.logs import get_logger

log = get_logger("bench")

#: the server's default context bound (runtime/config.py, MAX_MODEL_LEN)
_DEFAULT_CONTEXT = 4096


async def run_trace_command(args: argparse.Namespace, settings: dict[str, str]) -> int:
    policy = ScalePolicy(args.max_instances, args.slots, args.queue_threshold, args.idle_timeout, args.gpus,
                         args.pid_namespaces, args.instance_snapshot_dirs)
    max_len = args.max_len or context_length(args.model, settings)
    prompts = PromptMaker(args.model)
    context = {"command": "trace", "argv": args.argv, "machine": describe_machine(),
               "model": args.model or "(embedded)", "settings": settings, "duration_s": args.duration,
               "requests_per_rate": args.requests, "seed": args.seed,
               "prompt_mean": args.prompt_mean * args.length_scale,
               "output_mean": args.output_mean * args.length_scale, "max_len": max_len,
               "exact_prompt_lengths": prompts.exact, "policy": dataclasses.asdict(policy)}
    check_gpu_shares(policy, settings, bool(context["machine"]["gpus"]))
    check_snapshot_dirs(policy, args.snapshot_dir)
    warn_of_shared_snapshots(policy, args.modes)
    points: list[TracePoint] = []
    for mode in args.modes:
        unavailable: TracePoint | None = None
        for rate in args.rates:
            if unavailable:  # the snapshot will not appear between rates
                points.append(TracePoint(mode, rate, unavailable.status, unavailable.reason))
                continue
            shape = WorkloadShape(rate, args.duration, args.prompt_mean * args.length_scale,
                                  args.output_mean * args.length_scale, max_len, args.seed, args.requests)
            workload = make_workload(shape)
            log.info("trace: %s at %g requests/s, %d requests over %.1f s", mode, rate, len(workload),
                     workload[-1].arrival_s if workload else 0.0)
            point = await run_trace_point(mode, rate, workload, prompts, settings, policy,
                                          args.out / "logs" / f"trace-{mode}-{rate:g}", args.timeout, args.seed)
            points.append(point)
            if point.status == "skipped":
                unavailable = point
            write_trace_files(args.out, context, points, provenance(context))
    table, written = write_trace_files(args.out, context, points, provenance(context))
    print(f"{table}\n\nwrote {', '.join(map(str, written))}")
    return 1 if any(p.status == "failed" for p in points) else 0


def check_gpu_shares(policy: ScalePolicy, settings: dict[str, str], gpu_present: bool) -> None:
    """Refuse a pool whose instances cannot all fit their GPU: each may take GPU_MEMORY_UTILIZATION of it, so
    the later starts would fail for memory part way through the trace."""
    resolved = Settings.from_env({**os.environ, **settings})  # what the servers will read
    if resolved.device == "cpu" or (resolved.device == "auto" and not gpu_present):
        return
    per_gpu = -(-policy.max_instances // max(1, len(policy.gpus)))
    if per_gpu * resolved.gpu_memory_utilization > 1.0:
        raise BenchError(f"--max-instances {policy.max_instances} puts {per_gpu} instances on a GPU, each taking "
                         f"GPU_MEMORY_UTILIZATION={resolved.gpu_memory_utilization:g} of it: lower it (--set, and "
                         f"bake the snapshots with the same value), lower --max-instances or spread them with --gpus")


def check_snapshot_dirs(policy: ScalePolicy, snapshot_dir: str | None) -> None:
    """--instance-snapshot-dirs needs a directory for every instance that may run at once, and replaces
    --snapshot-dir rather than joining it."""
    dirs = policy.snapshot_dirs
    missing = [d for d in dirs if not Path(d).is_dir()]
    if missing:
        raise BenchError(f"--instance-snapshot-dirs: no such directory: {missing[0]}")
    if dirs and len(dirs) < policy.max_instances:
        raise BenchError(f"--instance-snapshot-dirs gives {len(dirs)} directories for --max-instances "
                         f"{policy.max_instances}: bake one snapshot directory per instance")
    if dirs and snapshot_dir:
        raise BenchError("--instance-snapshot-dirs replaces --snapshot-dir (and $SNAPSHOT_DIR): give one of them")


def warn_of_shared_snapshots(policy: ScalePolicy, modes: tuple[str, ...]) -> None:
    """Several instances restored at once from one CRIU snapshot on one host clash (its baked pids, its handoff
    socket): the later ones start cold and the mode is reported skipped, part way through a run."""
    restored = [m for m in modes if VARIANTS.get(m, (m,))[0] in ("gpu", "process")]
    if restored and policy.max_instances > 1 and not policy.snapshot_dirs:
        log.warning("trace: %s instances started at once restore one snapshot on this host, where a second restore "
                    "clashes with the first (docs/snapshots.md); give --instance-snapshot-dirs, one baked "
                    "snapshot directory per instance", ",".join(restored))


def write_trace_files(out: Path, context: dict[str, Any], points: list[TracePoint],
                      header: str) -> tuple[str, list[Path]]:
    """trace.json (CONTEXT and every point), trace.md (HEADER above the table) and, if a point ran, trace.png.
    Returns the markdown and the files written."""
    write_json(out / "trace.json", {**context, "points": [dataclasses.asdict(p) for p in points]})
    table = header + "\n\n" + trace_table(points)
    (out / "trace.md").write_text(table + "\n")
    written = [out / "trace.json", out / "trace.md"]
    ran = [dataclasses.asdict(p) for p in points if p.status == "ok"]
    if ran:
        plot_trace(ran, out / "trace.png", trace_title(context))
        written.append(out / "trace.png")
    return table, written


def points_from_json(data: dict[str, Any]) -> list[TracePoint]:
    """The points of a trace.json, as the bench recorded them."""
    return [TracePoint(**{**p, "instances": [StartRecord(**s) for s in p["instances"]]}) for p in data["points"]]


def context_length(model: str | None, settings: dict[str, str]) -> int:
    """What the servers will allow: MAX_MODEL_LEN, else the model's own context up to the default bound."""
    if settings.get("MAX_MODEL_LEN", "auto") not in ("", "auto"):
        return int(settings["MAX_MODEL_LEN"])
    config = Path(model).expanduser() / "config.json" if model and not model.startswith("s3://") else None
    if config and config.is_file():
        own = json.loads(config.read_text()).get("max_position_embeddings", _DEFAULT_CONTEXT)
        return min(int(own), _DEFAULT_CONTEXT)
    return _DEFAULT_CONTEXT
