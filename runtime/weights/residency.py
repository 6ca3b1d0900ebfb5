"""How much of a set of files is in the page cache, asked of the kernel (cachestat(2), Linux 6.5+) without
reading or mapping them. A restore uses it to choose who streams the weights (snapshots/process.py).

The kernel walks every page it is asked about: a whole file of 4 KiB pages costs about 15 ms per GiB (92 ms
for 6 GiB on the CPU machine), which put a tenth of a second before CRIU's hand-over for Llama-3-8B's 15 GiB.
So a large file is asked about in WINDOWS windows of WINDOW_BYTES spread over its length: the same answer for
a file read whole or not at all, and an estimate in between, at the cost of a 64 MiB file."""

from __future__ import annotations

import ctypes
import functools
import os
from pathlib import Path

SYS_CACHESTAT = 451  # the same number on x86_64 and arm64
#: a layout at least this much in the page cache counts as cached: a process restore's runtime then loads it
#: itself rather than through a helper (snapshots/process.py), and the entry point does not prefetch it
#: (runtime/weights/prefetch.py)
CACHED_ENOUGH = 0.95
WINDOWS = 64
WINDOW_BYTES = 1 << 20


class _Range(ctypes.Structure):
    _fields_ = [("off", ctypes.c_uint64), ("len", ctypes.c_uint64)]  # len 0: to the end of the file


class _Stat(ctypes.Structure):
    _fields_ = [(name, ctypes.c_uint64) for name in
                ("nr_cache", "nr_dirty", "nr_writeback", "nr_evicted", "nr_recently_evicted")]


@functools.cache
def _syscall():
    libc = ctypes.CDLL(None, use_errno=True)
    libc.syscall.restype = ctypes.c_long
    return libc.syscall


def cached_fraction(paths: list[str | os.PathLike]) -> float | None:
    """The share of the files' pages in the page cache (0.0-1.0), or None where the kernel cannot say (or a
    file cannot be opened: whoever reads them next will say why)."""
    page = os.sysconf("SC_PAGE_SIZE")
    cached = total = 0
    for path in paths:
        try:
            fd = os.open(path, os.O_RDONLY)
        except OSError:
            return None
        try:
            size = os.fstat(fd).st_size
            for start, length in _windows(size):
                pages = cached_pages(fd, start, length)
                if pages is None:
                    return None
                cached += pages
                total += -(-min(length or size, size - start) // page)
        finally:
            os.close(fd)
    return min(1.0, cached / total) if total else 1.0


def cached_bytes(path: str | os.PathLike) -> int | None:
    """Bytes of PATH in the page cache, every page asked about; None where the kernel cannot say or the file
    cannot be opened."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return None
    try:
        pages = cached_pages(fd, 0, 0)
        return None if pages is None else min(pages * os.sysconf("SC_PAGE_SIZE"), os.fstat(fd).st_size)
    finally:
        os.close(fd)


def cached_pages(fd: int, start: int, length: int) -> int | None:
    """Pages of the file FD in the page cache from START for LENGTH bytes (0: to its end); None where the
    kernel cannot say."""
    stat = _Stat()
    if _syscall()(ctypes.c_long(SYS_CACHESTAT), ctypes.c_int(fd), ctypes.byref(_Range(start, length)),
                  ctypes.byref(stat), ctypes.c_uint(0)) != 0:
        return None
    return stat.nr_cache


def _windows(size: int) -> list[tuple[int, int]]:
    """(offset, length) ranges to ask about: the whole file (length 0) when it is small, else WINDOWS
    page-aligned windows from its start to its end."""
    if size <= WINDOWS * WINDOW_BYTES * 2:
        return [(0, 0)]
    step = (size - WINDOW_BYTES) // (WINDOWS - 1)
    return [((k * step) // WINDOW_BYTES * WINDOW_BYTES, WINDOW_BYTES) for k in range(WINDOWS)]


def files_in(directory: Path) -> list[Path]:
    return sorted(p for p in directory.iterdir() if p.is_file())
