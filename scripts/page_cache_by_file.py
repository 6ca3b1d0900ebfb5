"""Which files under some folders are in the page cache, and how much of each: run right after a start from a
dropped page cache (`faas-bench coldstart --page-cache dropped`, which ends with that start), it says what the
start read from disk, file by file (and whatever else read meanwhile). The bench's `read to exit` column is
the total; this is where it came from.

    python scripts/page_cache_by_file.py /tmp/thawllm-models/llama-3-8b-baked /tmp/site /usr/lib --top 25

Prints the total and the files holding the most, one per line; --json writes every file with cached bytes.
Needs cachestat(2) (Linux 6.5+). Exit 2 with one line on bad input.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from runtime.weights.residency import cached_bytes

GiB, MiB = 1 << 30, 1 << 20


def cached_by_file(roots: list[Path]) -> dict[str, int]:
    """Every regular file under ROOTS (not following links) with bytes in the page cache, those bytes."""
    if cached_bytes(__file__) is None:
        raise OSError("this kernel has no cachestat(2) (Linux 6.5+): the page cache cannot be asked")
    found: dict[str, int] = {}
    for root in roots:
        paths = [root] if root.is_file() else (Path(d) / f for d, _, files in os.walk(root) for f in files)
        for path in paths:
            if path.is_symlink() or not path.is_file() or str(path) in found:
                continue
            cached = cached_bytes(path)  # None: unreadable, as a file only root may open
            if cached:
                found[str(path)] = cached
    return found


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="page_cache_by_file.py", description=__doc__.split("\n\n")[0])
    parser.add_argument("roots", nargs="+", type=Path, help="folders (or files) to look through")
    parser.add_argument("--top", type=int, default=20, help="files to print, the largest first")
    parser.add_argument("--json", type=Path, help="write {file: cached bytes} of every file found here")
    args = parser.parse_args(argv)
    missing = [str(r) for r in args.roots if not r.exists()]
    if missing:
        print(f"page_cache_by_file.py: no such file or folder: {missing[0]}", file=sys.stderr)
        return 2
    try:
        found = cached_by_file(args.roots)
    except OSError as exc:
        print(f"page_cache_by_file.py: {exc}", file=sys.stderr)
        return 2
    ranked = sorted(found.items(), key=lambda item: -item[1])
    print(f"{sum(found.values()) / GiB:.3f} GiB in the page cache, in {len(found)} files")
    for path, cached in ranked[:args.top]:
        print(f"{cached / MiB:10.1f} MiB  {path}")
    if args.json:
        args.json.write_text(json.dumps(dict(ranked), indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
