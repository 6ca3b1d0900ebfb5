"""Draw a benchmark's figure again from the JSON it wrote (faas-bench coldstart and switch), as faas-bench drew
it: for a run whose PNG did not come back with its JSON, or a figure to check against its numbers.

    python scripts/replot.py coldstart docs/benchmarks/coldstart-h200-llama-3-8b.json out.png
    python scripts/replot.py switch docs/benchmarks/switch-latency-h100x2.json \\
        docs/benchmarks/multi-model-trace-h100x2.json out.png
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from runtime.bench.plots import coldstart_title, plot_coldstart, plot_switch, switch_title  # noqa: E402
from runtime.bench.records import ModeResult, StartRun  # noqa: E402


def coldstart(data: dict, out: Path) -> None:
    results = [ModeResult(m["mode"], m["status"], m["reason"], [StartRun(**r) for r in m["runs"]])
               for m in data["modes"].values()]
    plot_coldstart(results, out, coldstart_title(data))


def switch(latency: dict, trace: dict, out: Path) -> None:
    fresh = {k: min((r["spawn_to_first_token_s"] for r in v["runs"]), default=None)
             for k, v in latency["fresh"].items()}
    points = [p for p in trace["points"] if p["status"] == "ok"]
    plot_switch(latency["probes"], fresh, points, out, switch_title(latency))


def main() -> int:
    parser = argparse.ArgumentParser(prog="replot", description=__doc__.split("\n\n")[0])
    parser.add_argument("kind", choices=("coldstart", "switch"))
    parser.add_argument("files", nargs="+", type=Path, help="coldstart: its JSON; switch: switch-latency.json and "
                                                            "multi-model-trace.json; then the PNG to write")
    args = parser.parse_args()
    *inputs, out = args.files
    wanted = 1 if args.kind == "coldstart" else 2
    if len(inputs) != wanted:
        print(f"replot: {args.kind} takes {wanted} JSON file(s) and the PNG to write", file=sys.stderr)
        return 2
    try:
        data = [json.loads(p.read_text()) for p in inputs]
    except (OSError, ValueError) as exc:
        print(f"replot: {exc}", file=sys.stderr)
        return 2
    coldstart(data[0], out) if args.kind == "coldstart" else switch(data[0], data[1], out)
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
