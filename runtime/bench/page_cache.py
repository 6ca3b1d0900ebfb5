"""The page cache between runs: dropped (as after a reboot or on a fresh node) or warmed (as on a node that
just served the same image)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Iterator, Sequence, TypeVar

T = TypeVar("T")

_DROP_CACHES = Path("/proc/sys/vm/drop_caches")


def drop_page_cache() -> str | None:
    """Write back dirty pages, then drop the clean ones. Returns None, or why it was not permitted."""
    os.sync()
    try:
        _DROP_CACHES.write_text("3\n")
    except OSError as exc:  # not root, or /proc/sys read-only in a container
        return f"cannot drop the page cache: {exc.strerror or exc}"
    return None


def turns_from_dropped(ways: Sequence[T], rounds: int) -> Iterator[tuple[int, T]]:
    """(round, way) for ROUNDS rounds over WAYS in turn, the page cache dropped just before each is given: ways
    of reading compared side by side, each from cold disk. Raises PermissionError (why) where it cannot be
    dropped."""
    for round_ in range(1, rounds + 1):
        for way in ways:
            why_not = drop_page_cache()
            if why_not:
                raise PermissionError(why_not)
            yield round_, way


def files_under(root: Path) -> list[Path]:
    """ROOT itself if it is a file, else every file under it."""
    return [root] if root.is_file() else sorted(p for p in root.rglob("*") if p.is_file())


def warm_page_cache(paths: list[Path]) -> int:
    """Read every file under `paths` once so the next start finds them in memory. Returns bytes read."""
    total = 0
    for root in paths:
        for path in files_under(root):
            with open(path, "rb", buffering=0) as f:
                while chunk := f.read(16 << 20):
                    total += len(chunk)
    return total
