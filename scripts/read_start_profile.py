"""Print a start's sampled profile (PROFILE_START, runtime/start_profile.py): the timeline's stages, then per
thread the stretches in which its innermost frames stayed the same, in seconds since spawn.

    PROFILE_START=/tmp/profiles faas-bench coldstart ... --modes process
    python scripts/read_start_profile.py /tmp/profiles/start-*.jsonl --depth 3 --min-ms 2 --thread engine

A stretch ends where the innermost DEPTH frames change or the thread was not sampled for 10 ms; stretches
shorter than MIN_MS are left out.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import defaultdict
from pathlib import Path

#: a thread unsampled for longer than this ends its stretch
GAP_S = 0.01


def read(path: Path) -> tuple[list[dict], dict[str, list[tuple[float, list[str]]]]]:
    """(stages, thread -> [(seconds since spawn, frames innermost first)])."""
    stacks: dict[int, list[str]] = {}
    threads: dict[str, list[tuple[float, list[str]]]] = defaultdict(list)
    stages: list[dict] = []
    for line in path.read_text().splitlines():
        record = json.loads(line)
        if "frames" in record:
            stacks[record["stack"]] = record["frames"]
        for at, thread, stack in record.get("samples", ()):
            threads[thread].append((at, stacks[stack]))
        stages = record.get("stages", stages)
    return stages, threads


def stretches(samples: list[tuple[float, list[str]]], depth: int) -> list[tuple[float, float, list[str]]]:
    """(start, end, frames) for each run of samples whose innermost DEPTH frames are the same."""
    out: list[tuple[float, float, list[str]]] = []
    for at, frames in samples:
        key = frames[:depth]
        if out and out[-1][2] == key and at - out[-1][1] <= GAP_S:
            out[-1] = (out[-1][0], at, key)
        else:
            out.append((at, at, key))
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("profile", type=Path)
    parser.add_argument("--depth", type=int, default=3, help="innermost frames that name a stretch")
    parser.add_argument("--min-ms", type=float, default=2.0, help="shortest stretch printed")
    parser.add_argument("--thread", default="", help="only threads whose name contains this")
    args = parser.parse_args()
    try:
        stages, threads = read(args.profile)
    except (OSError, ValueError, KeyError) as exc:
        print(f"read_start_profile: {args.profile}: {exc}", file=sys.stderr)
        return 2
    for stage in stages:
        end = "" if stage["end_s"] is None else f"{stage['end_s']:8.4f}"
        print(f"stage {stage['stage']:20s} {stage['start_s']:8.4f} {end}")
    for thread, samples in sorted(threads.items(), key=lambda item: item[1][0][0]):
        if args.thread not in thread:
            continue
        print(f"\n{thread} ({len(samples)} samples)")
        for start, end, frames in stretches(samples, args.depth):
            if (end - start) * 1000 >= args.min_ms:
                print(f"  {start:8.4f} {(end - start) * 1000:7.1f} ms  {' < '.join(frames)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
