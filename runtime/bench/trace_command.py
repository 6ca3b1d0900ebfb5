"""`faas-bench trace`: every mode at every rate, then the table, trace.json, trace.md and trace.png."""

from __future__ import annotations

import argparse
import dataclasses
import json
from pathlib import Path

from runtime.bench.machine import describe_machine
from runtime.bench.plots import plot_trace
from runtime.bench.pool import ScalePolicy
from runtime.bench.prompt import PromptMaker
from runtime.bench.report import provenance, trace_table, write_json
from runtime.bench.trace import TracePoint, run_trace_point
from runtime.bench.workload import WorkloadShape, make_workload
from runtime.logs import get_logger

log = get_logger("bench")

#: the server's default context bound (runtime/config.py, MAX_MODEL_LEN)
_DEFAULT_CONTEXT = 4096


async def run_trace_command(args: argparse.Namespace, settings: dict[str, str]) -> int:
    policy = ScalePolicy(args.max_instances, args.slots, args.queue_threshold, args.idle_timeout, args.gpus)
    max_len = args.max_len or context_length(args.model, settings)
    prompts = PromptMaker(args.model)
    points: list[TracePoint] = []
    for mode in args.modes:
        unavailable: TracePoint | None = None
        for rate in args.rates:
            if unavailable:  # the snapshot will not appear between rates
                points.append(TracePoint(mode, rate, unavailable.status, unavailable.reason))
                continue
            shape = WorkloadShape(rate, args.duration, args.prompt_mean * args.length_scale,
                                  args.output_mean * args.length_scale, max_len, args.seed)
            workload = make_workload(shape)
            log.info("trace: %s at %g requests/s, %d requests over %g s", mode, rate, len(workload), args.duration)
            point = await run_trace_point(mode, rate, workload, prompts, settings, policy,
                                          args.out / "logs" / f"trace-{mode}-{rate:g}", args.timeout, args.seed)
            points.append(point)
            if point.status == "skipped":
                unavailable = point
    context = {"command": "trace", "argv": args.argv, "machine": describe_machine(),
               "model": args.model or "(embedded)", "settings": settings, "duration_s": args.duration,
               "seed": args.seed, "prompt_mean": args.prompt_mean * args.length_scale,
               "output_mean": args.output_mean * args.length_scale, "max_len": max_len,
               "exact_prompt_lengths": prompts.exact, "policy": dataclasses.asdict(policy)}
    write_json(args.out / "trace.json", {**context, "points": [dataclasses.asdict(p) for p in points]})
    table = trace_table(points)
    table = provenance(context) + "\n\n" + table
    (args.out / "trace.md").write_text(table + "\n")
    ran = [dataclasses.asdict(p) for p in points if p.status == "ok"]
    if ran:
        machine = context["machine"]
        plot_trace(ran, args.out / "trace.png", f"{context['model']} on {', '.join(machine['gpus']) or 'CPU'}, "
                                                f"{args.duration:g} s per rate ({machine['date_utc'][:10]})")
    print(table)
    written = [args.out / "trace.json", args.out / "trace.md"] + ([args.out / "trace.png"] if ran else [])
    print(f"\nwrote {', '.join(map(str, written))}")
    return 1 if any(p.status == "failed" for p in points) else 0


def context_length(model: str | None, settings: dict[str, str]) -> int:
    """What the servers will allow: MAX_MODEL_LEN, else the model's own context up to the default bound."""
    if settings.get("MAX_MODEL_LEN", "auto") not in ("", "auto"):
        return int(settings["MAX_MODEL_LEN"])
    config = Path(model).expanduser() / "config.json" if model and not model.startswith("s3://") else None
    if config and config.is_file():
        own = json.loads(config.read_text()).get("max_position_embeddings", _DEFAULT_CONTEXT)
        return min(int(own), _DEFAULT_CONTEXT)
    return _DEFAULT_CONTEXT
