"""How fast a layout's weight files come from a dropped page cache, read several ways side by side: the
weights' prefetch as it reads (runtime/weights/prefetch.py: threads taking 64 MiB pieces, each read in 8 MiB
calls), faas-bench's reference read (one 64 MiB call per piece: runtime/bench/disk_read.py), more threads, and
direct I/O (O_DIRECT: no page cache, so nothing another process could then find there). The page cache is
dropped before each read; the ways alternate for --rounds rounds. Needs root (drop_caches).

    python scripts/probe_weight_read.py /tmp/thawllm-models/llama-3-8b-baked/layout \\
        --ways 16x8,16x64,32x64,16x64direct --out weight-read-h200-llama-3-8b.json

A way is THREADSxCALL_MIB, with `direct` after it for O_DIRECT. Exit 2 with one line on bad input.
"""

from __future__ import annotations

import argparse
import json
import mmap
import os
import re
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from runtime.bench.page_cache import turns_from_dropped  # noqa: E402
from runtime.weights.prefetch import PIECE_BYTES, layout_files, pieces  # noqa: E402

MiB, GiB = 1 << 20, 1 << 30
#: O_DIRECT's alignment of offsets, lengths and buffers (the logical block size is at most this)
ALIGN = 4096


@dataclass(frozen=True)
class Way:
    threads: int
    call_bytes: int
    direct: bool

    @property
    def name(self) -> str:
        return f"{self.threads}x{self.call_bytes // MiB}{'direct' if self.direct else ''}"


def parse_way(text: str) -> Way:
    found = re.fullmatch(r"(\d+)x(\d+)(direct)?", text.strip())
    if not found or int(found[1]) < 1 or not 1 <= int(found[2]) <= PIECE_BYTES // MiB:
        raise ValueError(f"{text!r} is not a way (THREADSxCALL_MIB[direct], the call 1-{PIECE_BYTES // MiB} MiB)")
    return Way(int(found[1]), int(found[2]) * MiB, bool(found[3]))


def read_all(files: list[tuple[str, int]], way: Way) -> float:
    """Seconds to read every piece of FILES WAY's way; the buffers are made and touched before the clock."""
    flags = os.O_RDONLY | (os.O_DIRECT if way.direct else 0)
    fds = {path: os.open(path, flags) for path, _ in files}
    buffers = [mmap.mmap(-1, way.call_bytes) for _ in range(way.threads)]  # page-aligned, as O_DIRECT needs
    for buffer in buffers:
        buffer.write(b"\0" * way.call_bytes)
    free = list(buffers)

    def read(piece: tuple[str, int, int]) -> None:
        path, offset, length = piece
        buffer = free.pop()
        try:
            end = offset + length
            while offset < end:
                want = min(way.call_bytes, -(-(end - offset) // ALIGN) * ALIGN if way.direct else end - offset)
                if os.preadv(fds[path], [memoryview(buffer)[:want]], offset) <= 0:
                    return
                offset += want
        finally:
            free.append(buffer)

    try:
        started = time.perf_counter()
        with ThreadPoolExecutor(way.threads) as pool:
            list(pool.map(read, pieces(files)))
        return time.perf_counter() - started
    finally:
        for fd in fds.values():
            os.close(fd)
        for buffer in buffers:
            buffer.close()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("layout", type=Path, help="a faas-build layout directory")
    parser.add_argument("--ways", default="16x8,16x64", help="comma-separated THREADSxCALL_MIB[direct]")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args(argv)
    files = layout_files(str(args.layout))
    if not files:
        print(f"probe_weight_read: {args.layout} is not a faas-build layout with weight files", file=sys.stderr)
        return 2
    try:
        ways = [parse_way(text) for text in args.ways.split(",")]
    except ValueError as exc:
        print(f"probe_weight_read: --ways: {exc}", file=sys.stderr)
        return 2
    total = sum(size for _, size in files)
    seconds: dict[str, list[float]] = {way.name: [] for way in ways}
    try:
        for round_, way in turns_from_dropped(ways, args.rounds):
            try:
                seconds[way.name].append(round(read_all(files, way), 4))
            except OSError as exc:
                print(f"probe_weight_read: {way.name}: {exc}", file=sys.stderr)
                return 2
            print(f"round {round_}: {way.name} {seconds[way.name][-1]:.2f} s "
                  f"({total / GiB / seconds[way.name][-1]:.2f} GiB/s)", flush=True)
    except PermissionError as exc:
        print(f"probe_weight_read: {exc}", file=sys.stderr)
        return 2
    median = {name: statistics.median(values) for name, values in seconds.items()}
    report = {"layout": str(args.layout), "bytes": total, "piece_bytes": PIECE_BYTES, "rounds": args.rounds,
              "seconds": seconds, "median_s": median,
              "median_gib_s": {name: round(total / GiB / s, 3) for name, s in median.items()}}
    for name, s in median.items():
        print(f"{name}: {total / GiB:.2f} GiB, median {s:.2f} s ({total / GiB / s:.2f} GiB/s)")
    if args.out:
        args.out.write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
