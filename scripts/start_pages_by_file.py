"""What a snapshot's start-pages list (snapshots/start_pages.py) holds, file by file, the largest first: the MiB
listed, of which the early ranges (what criu reads first), the ranges, and the file's size.

    python scripts/start_pages_by_file.py /tmp/thawllm-models/llama-3-8b-baked/snapshots/process/start-pages.json

Prints a markdown table (--top N rows, all by default) and the total. Exit 2 with one line on bad input.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from snapshots.start_pages import read_list  # noqa: E402

MiB = 1 << 20


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("list", type=Path, help="a snapshot's start-pages.json")
    parser.add_argument("--top", type=int, help="only the N files with the most listed")
    args = parser.parse_args(argv)
    try:
        files = read_list(args.list)
    except (OSError, ValueError) as exc:
        print(f"start_pages_by_file: {exc}", file=sys.stderr)
        return 2
    files.sort(key=lambda f: f.bytes, reverse=True)
    print("| file | listed (MiB) | early (MiB) | ranges | file size (MiB) |")
    print("| --- | --- | --- | --- | --- |")
    for f in files[:args.top]:
        early, ranges = sum(length for _, length in f.early), len(f.early) + len(f.ranges)
        name = os.path.basename(f.path)
        print(f"| {name} | {f.bytes / MiB:.1f} | {early / MiB:.1f} | {ranges} | {f.size / MiB:.0f} |")
    print(f"{sum(f.bytes for f in files) / MiB:.1f} MiB of {len(files)} files")
    return 0


if __name__ == "__main__":
    sys.exit(main())
