"""Which thread count read a model's weights from cold disk faster, over `faas-bench coldstart --page-cache
dropped` runs: each run's reference reads (`disk_read`: by 8 and by 16 threads, once a round, or once before
the starts in older runs) paired round by round, and how many pairs each count won.

    python scripts/reference_read_threads.py docs/benchmarks/coldstart-h200-llama-3-8b-dropped*.json

Prints a line per run and the total. A run without both counts' reads is named and left out. Exit 2 with one
line on bad input.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def pairs(report: dict) -> list[tuple[float, float]]:
    """(8 threads' seconds, 16 threads' seconds) for each round of REPORT's reference read; [] without both."""
    read = report.get("disk_read") or {}
    by_threads = read.get("reads_by_threads") or {k: [v] for k, v in (read.get("seconds_by_threads") or {}).items()}
    if "8" not in by_threads or "16" not in by_threads:
        return []
    return list(zip(by_threads["8"], by_threads["16"]))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("runs", nargs="+", type=Path, help="faas-bench coldstart JSON files")
    args = parser.parse_args(argv)
    total = won_by_16 = 0
    for path in args.runs:
        try:
            run_pairs = pairs(json.loads(path.read_text()))
        except (OSError, ValueError, AttributeError) as exc:
            print(f"reference_read_threads: {path}: {exc}", file=sys.stderr)
            return 2
        if not run_pairs:
            print(f"{path.name}: no reads by both 8 and 16 threads")
            continue
        faster = sum(sixteen < eight for eight, sixteen in run_pairs)
        print(f"{path.name}: 16 threads faster in {faster} of {len(run_pairs)}")
        total, won_by_16 = total + len(run_pairs), won_by_16 + faster
    print(f"16 threads faster in {won_by_16} of {total} pairs, 8 threads in {total - won_by_16}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
