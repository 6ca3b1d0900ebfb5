"""Print, for each mode of a `faas-bench coldstart` JSON, the range over its starts of each stage's start, end and
length and of every number in the stage's detail: where the time of a table's starts went, as docs/benchmarks.md
quotes it.

    python scripts/coldstart_stage_ranges.py docs/benchmarks/coldstart-h200-llama-3-8b.json --modes process

A stage a start ran more than once (the image's check and the materialized snapshot's files) is named with its
detail's `snapshot`, where it has one.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import defaultdict
from pathlib import Path


def stage_values(runs: list[dict]) -> dict[str, dict[str, list[float]]]:
    """stage name -> value name -> the value in each start that has it."""
    found: dict[str, dict[str, list[float]]] = defaultdict(lambda: defaultdict(list))
    for run in runs:
        for stage in run["stages"]:
            detail = stage.get("detail") or {}
            name = stage["stage"] + (f" ({detail['snapshot']})" if stage["stage"] == "snapshot_verify" else "")
            for key in ("start_s", "end_s", "seconds"):
                if stage.get(key) is not None:  # a stage still running when the start was stopped has no end
                    found[name][key].append(stage[key])
            for key, value in detail.items():
                if isinstance(value, (int, float)) and not isinstance(value, bool):
                    found[name][key].append(value)
                elif isinstance(value, dict):  # the weights' tiers: {"disk": {"gib_s": ...}}
                    for tier, numbers in value.items():
                        for inner, number in (numbers.items() if isinstance(numbers, dict) else ()):
                            if isinstance(number, (int, float)):
                                found[name][f"{key}.{tier}.{inner}"].append(number)
    return found


def describe(values: list[float]) -> str:
    low, high = min(values), max(values)
    if all(float(v).is_integer() for v in values):
        return f"{low:.0f}" if low == high else f"{low:.0f}-{high:.0f}"
    return f"{low:.3f}" if low == high else f"{low:.3f}-{high:.3f}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("run", type=Path, help="a faas-bench coldstart JSON")
    parser.add_argument("--modes", help="comma-separated modes (default: every mode with starts)")
    args = parser.parse_args(argv)
    try:
        modes = json.loads(args.run.read_text())["modes"]
    except (OSError, ValueError, KeyError) as exc:
        print(f"coldstart_stage_ranges: {args.run}: not a faas-bench coldstart JSON ({exc})", file=sys.stderr)
        return 2
    wanted = args.modes.split(",") if args.modes else [m for m, r in modes.items() if r.get("runs")]
    unknown = [m for m in wanted if m not in modes]
    if unknown:
        print(f"coldstart_stage_ranges: no mode {', '.join(unknown)} in {args.run} (it has {', '.join(modes)})",
              file=sys.stderr)
        return 2
    for mode in wanted:
        runs = modes[mode]["runs"]
        print(f"{mode}: {len(runs)} starts, spawn to first token "
              f"{describe([r['spawn_to_first_token_s'] for r in runs])} s")
        for stage, values in stage_values(runs).items():
            print(f"  {stage}: " + ", ".join(f"{key} {describe(v)}" for key, v in values.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
