"""The machine's physical disks while a command runs, sampled: reads completed, bytes read, requests in flight and
the time the disks were busy (/proc/diskstats), every --every seconds, so that a start's reads can be set beside a
plain read of the same bytes (how many requests, how large, how many in flight at once).

    python scripts/sample_disk_queue.py --out disk-queue.json -- faas-bench coldstart ... --page-cache dropped
    python scripts/sample_disk_queue.py --summarize disk-queue.json --plot disk-queue.png

The summary splits the samples into the stretches the disks were reading (apart by at least IDLE_GAP_S of next to
no reading) and gives each one, and its first second, the rate, the requests and how many were in flight.

Writes {"command", "every_s", "began_at" (time.time() when it began), "samples": [[seconds since the command
began, reads completed, bytes read, requests in flight, ms busy], ...]}, summed over the disks
runtime/bench/disk_read.py counts. Exit 2 with one
line on bad input; otherwise the command's exit status.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from runtime.bench.disk_read import SECTOR, physical_disk_stats  # noqa: E402
from runtime.bench.plots import plot_disk_queue  # noqa: E402


GiB, MiB, KiB = 1 << 30, 1 << 20, 1 << 10
#: reading slower than this, this long, ends a stretch of reading (writes are not counted: a page-cache drop's
#: write-back, a log)
IDLE_READ_BYTES_S, IDLE_GAP_S = 16 * MiB, 0.3


def busy_stretches(samples: list[list[float]]) -> list[tuple[int, int]]:
    """(first, last) sample indices of each stretch the disks were reading."""
    stretches, first, idle_since = [], None, None
    for i in range(1, len(samples)):
        dt = samples[i][0] - samples[i - 1][0]
        busy = dt > 0 and (samples[i][2] - samples[i - 1][2]) / dt > IDLE_READ_BYTES_S
        if busy:
            first = i - 1 if first is None else first
            idle_since = None
        elif first is not None:
            idle_since = i - 1 if idle_since is None else idle_since
            if samples[i][0] - samples[idle_since][0] >= IDLE_GAP_S:
                stretches.append((first, idle_since))
                first = idle_since = None
    if first is not None:
        stretches.append((first, idle_since if idle_since is not None else len(samples) - 1))
    return stretches


def describe(samples: list[list[float]], first: int, last: int) -> dict:
    a, b = samples[first], samples[last]
    seconds, reads, nbytes = b[0] - a[0], b[1] - a[1], b[2] - a[2]
    in_flight = [x[3] for x in samples[first + 1:last + 1]]
    return {"from_s": a[0], "seconds": round(seconds, 2), "gib": round(nbytes / GiB, 2),
            "gib_s": round(nbytes / GiB / seconds, 2) if seconds else None, "reads": reads,
            "mean_read_kib": round(nbytes / KiB / reads) if reads else None,
            "mean_in_flight": round(sum(in_flight) / len(in_flight), 1) if in_flight else None}


def summarize(samples: list[list[float]]) -> list[dict]:
    """Each busy stretch, then its first second, described."""
    rows = []
    for first, last in busy_stretches(samples):
        rows.append({"part": "whole"} | describe(samples, first, last))
        second = next((i for i in range(first, last + 1) if samples[i][0] - samples[first][0] >= 1.0), None)
        if second is not None and second < last:
            rows.append({"part": "first second"} | describe(samples, first, second))
    return rows


def print_summary(rows: list[dict]) -> None:
    print("| part | from (s) | seconds | GiB | GiB/s | reads | mean read (KiB) | mean in flight |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for r in rows:
        print(f"| {r['part']} | {r['from_s']:.1f} | {r['seconds']} | {r['gib']} | {r['gib_s']} | {r['reads']} "
              f"| {r['mean_read_kib']} | {r['mean_in_flight']} |")


def sample(every_s: float, stop: threading.Event, began: float, samples: list[list[float]]) -> None:
    while True:
        stats = physical_disk_stats()
        samples.append([round(time.monotonic() - began, 4), stats.reads, stats.sectors * SECTOR, stats.in_flight,
                        stats.busy_ms])
        if stop.wait(every_s):
            return


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--every", type=float, default=0.05, help="seconds between samples")
    parser.add_argument("--out", type=Path)
    parser.add_argument("--summarize", type=Path, help="summarize a file this wrote, and run nothing")
    parser.add_argument("--plot", type=Path, help="with --summarize: a PNG of the rate and the queue over time")
    parser.add_argument("command", nargs=argparse.REMAINDER, help="-- then the command to run")
    args = parser.parse_args(argv)
    if args.summarize is not None:
        try:
            samples = json.loads(args.summarize.read_text())["samples"]
            print_summary(summarize(samples))
        except (OSError, ValueError, KeyError, TypeError, IndexError) as exc:
            print(f"sample_disk_queue: {args.summarize}: not samples this wrote ({exc})", file=sys.stderr)
            return 2
        if args.plot is not None:
            plot_disk_queue(samples, args.plot)
        return 0
    if args.out is None:
        print("sample_disk_queue: give --out FILE for the samples", file=sys.stderr)
        return 2
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command or args.every <= 0:
        print("sample_disk_queue: give a command after -- and --every above 0", file=sys.stderr)
        return 2
    if physical_disk_stats() is None:
        print("sample_disk_queue: this kernel does not say what its disks read (/proc/diskstats)", file=sys.stderr)
        return 2
    samples: list[list[float]] = []
    stop = threading.Event()
    began_at, began = time.time(), time.monotonic()
    sampler = threading.Thread(target=sample, args=(args.every, stop, began, samples), daemon=True)
    sampler.start()
    try:
        status = subprocess.call(command)
    except OSError as exc:
        print(f"sample_disk_queue: {command[0]}: {exc.strerror or exc}", file=sys.stderr)
        return 2
    finally:
        stop.set()
        sampler.join()
    args.out.write_text(json.dumps({"command": command, "every_s": args.every, "began_at": began_at,
                                     "samples": samples}))
    print_summary(summarize(samples))
    return status


if __name__ == "__main__":
    sys.exit(main())
