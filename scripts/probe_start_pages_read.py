"""How fast a snapshot's start pages come into a dropped page cache: one read in flight per thread, as the
entry point reads them (runtime/read_ahead.py: each thread reads a piece, then the next), against every read
queued at once (POSIX_FADV_WILLNEED for every piece, then a read of each that waits for it). The page cache
is dropped before each read; the two alternate for --rounds rounds. Needs root (drop_caches).

    python scripts/probe_start_pages_read.py /tmp/thawllm-models/llama-3-8b-baked/snapshots/process/start-pages.json \
        --out start-pages-read-h200.json

Exit 2 with one line on bad input.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from runtime.bench.page_cache import turns_from_dropped  # noqa: E402
from runtime.read_ahead import Piece, ReadAhead  # noqa: E402
from snapshots.start_pages import pieces, read_list  # noqa: E402


def one_per_thread(listed: list[Piece], readers: int) -> float:
    read = ReadAhead("start pages", listed, readers, exact=True)
    read.join()
    return read.ended - read.started


def queued(listed: list[Piece], readers: int) -> float:
    started = time.time()
    fds: dict[str, int] = {}
    for path, offset, length in listed:
        if path not in fds:
            fds[path] = os.open(path, os.O_RDONLY)
            os.posix_fadvise(fds[path], 0, 0, os.POSIX_FADV_RANDOM)
        os.posix_fadvise(fds[path], offset, length, os.POSIX_FADV_WILLNEED)  # queued; returns at once
    try:
        with ThreadPoolExecutor(readers) as pool:  # each read waits for its pages to arrive
            list(pool.map(lambda piece: os.pread(fds[piece[0]], piece[2], piece[1]), listed))
    finally:
        for fd in fds.values():
            os.close(fd)
    return time.time() - started


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("list", type=Path, help="a snapshot's start-pages.json")
    parser.add_argument("--readers", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args(argv)
    try:
        listed = pieces(read_list(args.list))
    except (OSError, ValueError) as exc:
        print(f"probe_start_pages_read: {exc}", file=sys.stderr)
        return 2
    if not listed:
        print(f"probe_start_pages_read: {args.list}: no piece of it is as it was baked", file=sys.stderr)
        return 2
    seconds: dict[str, list[float]] = {"one per thread": [], "queued": []}
    try:
        for round_, (name, read) in turns_from_dropped((("one per thread", one_per_thread), ("queued", queued)),
                                                       args.rounds):
            seconds[name].append(round(read(listed, args.readers), 4))
            print(f"round {round_}: {name} {seconds[name][-1]:.3f} s", flush=True)
    except PermissionError as exc:
        print(f"probe_start_pages_read: {exc}", file=sys.stderr)
        return 2
    total = sum(length for _, _, length in listed)
    report = {"list": str(args.list), "bytes": total, "pieces": len(listed), "readers": args.readers,
              "seconds": seconds, "median_s": {k: statistics.median(v) for k, v in seconds.items()}}
    for name, median in report["median_s"].items():
        print(f"{name}: {total / 2**20:.1f} MiB in {len(listed)} pieces, median {median:.3f} s "
              f"({total / 2**30 / median:.2f} GiB/s)")
    if args.out:
        args.out.write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
