"""The file pages a start from a CRIU snapshot touches: listed by faas-build, read at boot before the restored
runtime touches them (the list is made by snapshots/start_pages_record.py).

A restored runtime reaches its libraries (libtorch, cuBLAS, the CUDA driver...) through file mappings that
CRIU gives back unread: each first touch is a page fault. From cold disk the kernel reads around every such
fault (up to the disk's read-ahead window, 8 MiB on the GPU machine, and executable mappings whatever the
advice), so a start reads several times what it touches, one fault at a time, while the weights stream from
the same disk. So faas-build starts the function from each CRIU snapshot once, serves two requests, and lists
the file pages its processes then hold (/proc/PID/pagemap: present in their page tables); the entry point reads
exactly those (POSIX_FADV_RANDOM: nothing around them) on READERS threads from its first instruction, before
the weights' prefetch (runtime/read_ahead.py). The faults then find their pages in the page cache.

The list decides what is read into the page cache, never what is restored or served: a file whose size or
modification time differs from the listed one is left out, and without a list nothing is read.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass

from runtime.read_ahead import READ_BYTES, Piece, ReadAhead, piece_pages

LIST_FILE = "start-pages.json"
READERS = 8


@dataclass(frozen=True)
class FilePages:
    path: str
    size: int
    mtime_ns: int
    #: (offset, length) ranges, in order, apart: what CRIU's restore reads (the header it checks, the pages it
    #: writes its copies over), then the rest of what the restored runtime touched
    early: tuple[tuple[int, int], ...]
    ranges: tuple[tuple[int, int], ...]

    @property
    def bytes(self) -> int:
        return sum(length for _, length in (*self.early, *self.ranges))


def read_list(path: str | os.PathLike) -> list[FilePages]:
    """The list at PATH. Raises OSError or ValueError where it is missing or not one."""
    with open(path) as f:
        record = json.load(f)
    try:
        return [FilePages(str(e["path"]), int(e["size"]), int(e["mtime_ns"]), _pairs(e["early"]), _pairs(e["ranges"]))
                for e in record["files"]]
    except (KeyError, TypeError) as exc:
        raise ValueError(f"{path}: not a list of start pages ({exc})") from None


def _pairs(ranges) -> tuple[tuple[int, int], ...]:
    return tuple((int(offset), int(length)) for offset, length in ranges)


def pieces(files: list[FilePages]) -> list[Piece]:
    """The ranges of FILES still as listed (size and modification time), in pieces of at most READ_BYTES: every
    file's early ranges, then every file's others."""
    same = []
    for file in files:
        try:
            stat = os.stat(file.path)
        except OSError:
            continue
        if (stat.st_size, stat.st_mtime_ns) == (file.size, file.mtime_ns):
            same.append(file)
    return [(file.path, start, min(READ_BYTES, offset + length - start))
            for ranges in ("early", "ranges") for file in same for offset, length in getattr(file, ranges)
            for start in range(offset, offset + length, READ_BYTES)]


#: this process's read of the start pages, once the entry point started one, and why not when it did not
current: ReadAhead | None = None
skipped: str | None = None


def start(snapshot_dir: str, kind: str) -> ReadAhead | None:
    """Start reading the pages listed for SNAPSHOT_DIR's KIND snapshot (`current`), else say why not
    (`skipped`). Never raises."""
    global current, skipped
    current = skipped = None
    try:
        listed = pieces(read_list(os.path.join(snapshot_dir, kind, LIST_FILE)))
        skipped = None if listed else "none of the listed files is as it was baked"
        if listed and _ends_cached(listed):
            skipped = "the listed pages are in the page cache"
        if skipped is None:
            current = ReadAhead("start pages", listed, READERS, exact=True)
    except FileNotFoundError:
        skipped = f"no {LIST_FILE} beside the {kind} snapshot"
    except Exception as exc:  # noqa: BLE001 - the restored runtime faults its pages in, as without it
        skipped = f"{type(exc).__name__}: {exc}"
    return current


def _ends_cached(listed: list[Piece]) -> bool:
    """Whether CACHED_ENOUGH of the pages of the files' first and last listed pieces, together, are in the page
    cache: a warm start reads nothing."""
    from runtime.weights.residency import CACHED_ENOUGH

    ends: dict[str, list[Piece]] = {}
    for piece in listed:
        ends.setdefault(piece[0], [piece, piece])[1] = piece
    cached = total = 0
    for path, pair in ends.items():
        fd = os.open(path, os.O_RDONLY)
        try:
            for _, offset, length in pair:
                found, pages = piece_pages(fd, offset, length)
                cached, total = cached + found, total + pages
        finally:
            os.close(fd)
    return cached >= CACHED_ENOUGH * total


def log_start() -> None:
    """The boot log's line for what the entry point did: at info when it reads, at debug why it does not."""
    from runtime.logs import get_logger

    if current is not None:
        current.announce()
    elif skipped is not None:
        get_logger("read_ahead").debug("start pages: not read: %s", skipped)
