"""`faas-bench coldstart`: run, then print the table and write coldstart.json, coldstart.md, coldstart.png."""

from __future__ import annotations

import argparse
from pathlib import Path

from runtime.bench.coldstart import ColdStartPlan, run_coldstart
from runtime.bench.disk_read import DiskRead
from runtime.bench.machine import describe_machine
from runtime.bench.plots import coldstart_title, plot_coldstart
from runtime.bench.report import provenance, coldstart_json, coldstart_table, write_json


async def run_coldstart_command(args: argparse.Namespace, settings: dict[str, str]) -> int:
    reference = None
    if args.page_cache == "dropped" and args.model and Path(args.model).exists():
        # what a start from cold disk is held against: the model read at the disk's best parallel rate, each round
        reference = DiskRead.of(Path(args.model))
    plan = ColdStartPlan(model=args.model, modes=args.modes, repeat=args.repeat, page_cache=args.page_cache,
                         settings=settings, log_dir=args.out / "logs", prompt_tokens=args.prompt_tokens,
                         max_tokens=args.max_tokens, timeout_s=args.timeout,
                         baseline_model=str(args.baseline_model) if args.baseline_model else None)
    results = await run_coldstart(plan, reference)
    disk_read = reference if reference is not None and reference.seconds else None
    context = {"command": "coldstart", "argv": args.argv, "machine": describe_machine(),
               "model": args.model or "(embedded)", "settings": settings, "page_cache": args.page_cache,
               "repeat": args.repeat, "prompt_tokens": args.prompt_tokens, "max_tokens": args.max_tokens}
    if disk_read is not None:
        context["disk_read"] = disk_read.as_dict()
    table = coldstart_table(results)
    if disk_read is not None:
        table += "\n\n" + disk_read.summary()
    write_json(args.out / "coldstart.json", coldstart_json(results, context))
    table = provenance(context) + "\n\n" + table
    (args.out / "coldstart.md").write_text(table + "\n")
    plot_coldstart(results, args.out / "coldstart.png", coldstart_title(context))
    print(table)
    print(f"\nwrote {args.out / 'coldstart.json'}, {args.out / 'coldstart.png'}, {args.out / 'coldstart.md'}")
    return 1 if any(r.status == "failed" for r in results) else 0
