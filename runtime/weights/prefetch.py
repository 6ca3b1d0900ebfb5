"""The weight files read into the page cache from the entry point's first instruction, when they are not
there (runtime/entry.py; PREFETCH_WEIGHTS).

From cold disk the weights are most of what a start reads (15 GiB for Llama-3-8B), yet whoever streams them
starts late: a process restore's weight helper once its own CUDA context exists, a cold start once torch is
imported (seconds). Read into the page cache at once, READERS threads at a time (PREFETCH_READERS) in the
layout's order (the order every stream reads them in), right after the start pages where there are some
(snapshots/start_pages.py), they are there when the stream comes, or being read: the kernel then waits for the
same read rather than starting another. Nothing waits for the prefetch itself. While a CRIU restore the entry
point started is under way, only RESTORE_READERS of the threads read (PREFETCH_RESTORE_READERS); the bootstrap
`widen`s it to all of them once the restore has handed over, or once it knows that it restores nothing. A
process restore that serves before the embedding table is in (EMBEDDING_LAST) has the table's pieces read last,
each started only once every other piece has been read: the other weights, which the first token waits for,
do not share the disk with them, and only TABLE_READERS threads read them (PREFETCH_TABLE_READERS): the
runtime, serving by then, reads the rows its steps need behind them.

It is left out where it cannot help: the weights in the page cache already (runtime/weights/residency.py, or
a kernel that cannot say), more of them than the memory available (they would evict each other), a model
that is not a local faas-build layout.

Imports: os, json and runtime/read_ahead.py's (threading, time), and the page-cache check's own (ctypes), all
once the entry point has started CRIU.
"""

from __future__ import annotations

import json
import os
import time

from runtime.read_ahead import Piece, ReadAhead

#: threads reading at once (PREFETCH_READERS): on the GPU machine's disk 16 threads read a layout about as fast as
#: 8 (faster in 15 of the 36 reference reads faas-bench made), and starts from cold disk with 16 came as soon
#: as with 8 over the four runs that compared them (docs/weights.md)
READERS = 16
#: of which read while CRIU restores (PREFETCH_RESTORE_READERS), until the restore has handed over: the
#: restore's own small reads (the bootstrap's imports, CRIU's image, what the start pages do not hold) wait
#: behind fewer large ones. On the GPU machine the restore of Llama-3-8B from cold disk then handed over 1.2-1.6 s
#: after spawn instead of 2.7-5.9 s, and no start waited for the weights' helper after their last read; the
#: median start was no faster (docs/benchmarks.md)
RESTORE_READERS = 4
#: of which read the embedding table's pieces, last of a restore that serves before they are in
#: (PREFETCH_TABLE_READERS): the rows a step reads from the layout meanwhile wait behind fewer large reads. On the
#: GPU machine Llama-3-8B's first token then came 0.09-0.15 s after ready from cold disk instead of 0.12-0.18 s
#: (docs/benchmarks.md)
TABLE_READERS = 4
#: what one thread reads before it takes the next piece
PIECE_BYTES = 64 << 20
#: the share of the memory available the weights may take
MEMORY_SHARE = 0.8


def pieces(files: list[tuple[str, int]], last: tuple[str, int, int] | None = None) -> list[Piece]:
    """FILES ((path, size), in the layout's order) in pieces of PIECE_BYTES; those inside LAST (a path and its
    bytes [start, end): the embedding table's part a restore reads last) after all the others."""
    first, later = _split(files, last)
    return first + later


def _split(files: list[tuple[str, int]], last: tuple[str, int, int] | None) -> tuple[list[Piece], list[Piece]]:
    every = [(path, offset, min(PIECE_BYTES, size - offset)) for path, size in files
             for offset in range(0, size, PIECE_BYTES)]
    if last is None:
        return every, []
    path, start, end = last
    first: list[Piece] = []
    later: list[Piece] = []
    for piece in every:
        inside = piece[0] == path and piece[1] >= start and piece[1] + piece[2] <= end
        (later if inside else first).append(piece)
    return first, later


def layout_files(model: str) -> list[tuple[str, int]] | None:
    """The weight files of MODEL, a faas-build layout directory, from its manifest; None if it is not one."""
    found = _layout(model, embedding_last=False)
    return None if found is None else found[0]


def _layout(model: str, embedding_last: bool) -> tuple[list[tuple[str, int]], tuple[str, int, int] | None] | None:
    """MODEL's weight files and, with EMBEDDING_LAST, the part of its embedding table a restore reads last
    (runtime/weights/embedding_blocks.py) or None; None if MODEL is not a local faas-build layout. The table's
    block digests, which the restored runtime reads while the weights arrive, come first of the files then."""
    if not model or "://" in model:
        return None
    directory = os.path.expanduser(model)
    try:
        with open(os.path.join(directory, "manifest.json")) as f:
            manifest = json.load(f)
        files = [(os.path.join(directory, e["name"]), int(e["size"])) for e in manifest["files"]]
        last = None
        if embedding_last:
            from runtime.weights.embedding_blocks import BLOCKS_FILE, raw_deferred_span

            span = raw_deferred_span(manifest)
            if span is not None:
                last = (os.path.join(directory, span[0]), span[1], span[2])
                digests = os.path.join(directory, BLOCKS_FILE)
                files.insert(0, (digests, os.stat(digests).st_size))
        return files, last
    except (OSError, ValueError, KeyError, TypeError):
        return None


def why_not(files: list[tuple[str, int]]) -> str | None:
    """Why FILES are not prefetched, or None when they should be."""
    total = sum(size for _, size in files)
    available = memory_available()
    if available is not None and total > MEMORY_SHARE * available:
        return f"{total / 2**30:.1f} GiB of weights, {available / 2**30:.1f} GiB of memory available"
    from runtime.weights.residency import CACHED_ENOUGH, cached_fraction

    cached = cached_fraction([path for path, _ in files])
    if cached is None:
        return "the kernel cannot say what is in the page cache"
    if cached >= CACHED_ENOUGH:
        return f"{100 * cached:.0f}% of the weights in the page cache"
    return None


def memory_available() -> int | None:
    """Bytes of memory this process may still fill: the kernel's MemAvailable, and below its cgroup's limit
    (cgroup v2), whichever is less; None if neither can be read."""
    found = []
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    found.append(int(line.split()[1]) * 1024)
                    break
    except (OSError, ValueError):
        pass
    try:
        with open("/sys/fs/cgroup/memory.max") as f:
            limit = f.read().strip()
        if limit != "max":
            with open("/sys/fs/cgroup/memory.current") as f:
                found.append(int(limit) - int(f.read()))
    except (OSError, ValueError):
        pass
    return min(found) if found else None


#: this process's prefetch, once the entry point started one, and why it did not when it did not
current: ReadAhead | None = None
skipped: str | None = None


def readers(text: str | None, default: int = READERS) -> int:
    """PREFETCH_READERS's (or PREFETCH_RESTORE_READERS's, PREFETCH_TABLE_READERS's) text as a count of threads;
    DEFAULT where it is unset or not a positive number (the bootstrap's parse of the settings says what is wrong
    with it)."""
    try:
        count = int(text) if text is not None else default
    except ValueError:
        return default
    return count if count > 0 else default


def start(model: str | None, after: ReadAhead | None = None, readers: int = READERS,
          restore_readers: int | None = None, embedding_last: bool = False,
          table_readers: int = TABLE_READERS) -> ReadAhead | None:
    """Start prefetching MODEL's weights (`current`) on READERS threads, once AFTER has been read if given,
    else say why not (`skipped`); on RESTORE_READERS of them until `widen()`; with EMBEDDING_LAST (a process
    restore that may defer part of the table) that part last, on TABLE_READERS of them. Never raises."""
    global current, skipped
    current = skipped = None
    try:
        found = _layout(model or "", embedding_last)
        skipped = "not a local faas-build layout" if found is None else why_not(found[0])
        if skipped is None:
            first, later = _split(*found)
            # the table's pieces wait until every other piece is in: the last of the other weights, which the
            # first token waits for, then has the disk to itself
            current = ReadAhead("weights prefetch", first + later, readers, after, first_readers=restore_readers,
                                last=len(later), last_readers=table_readers)
    except Exception as exc:  # noqa: BLE001 - the weights are read by whoever streams them, as without it
        skipped = f"{type(exc).__name__}: {exc}"
    return current


def widen() -> None:
    """The restore has handed over, or this start restores nothing: the prefetch reads with all its threads."""
    if current is not None and current.widen():
        from runtime.logs import get_logger

        get_logger("weights.prefetch").info("weights prefetch: %d threads from %.2f s after it began",
                                            current.readers, time.time() - current.started)


def log_start() -> None:
    """The boot log's line for what the entry point did: at info when it prefetches, at debug why it does not
    (nothing where it was not asked to)."""
    from runtime.logs import get_logger

    if current is not None:
        current.announce()
    elif skipped is not None:
        get_logger("weights.prefetch").debug("weights prefetch: not needed or not possible: %s", skipped)
