"""Pieces of files read into the page cache on threads, from the entry point's first instruction: the file
pages a restored runtime will touch (snapshots/start_pages.py), then the weights (runtime/weights/prefetch.py).
Nothing waits for a read-ahead: whoever reads the same bytes later finds them in the page cache, or waits for
the read in flight rather than starting another. A read that fails ends that thread's share quietly (`error`
says what failed): whoever needs the bytes reads them, and says what is wrong.

Imports: itertools, os, threading and time (the entry point imports this once it has started CRIU); the page-cache
checks import ctypes (runtime/weights/residency.py) when first made.
"""

from __future__ import annotations

import itertools
import os
import threading
import time

#: what one read asks for at most
READ_BYTES = 8 << 20

#: (path, offset, length)
Piece = tuple[str, int, int]


class ReadAhead:
    """READERS threads reading PIECES, in order, into the page cache. AFTER: an earlier read-ahead whose end
    these threads wait for first (the disk serves one at a time best). EXACT: exactly the pieces, with no
    read-ahead of the kernel's around them (POSIX_FADV_RANDOM on each file), and a piece already in the page
    cache is not read again. FIRST_READERS: how many of the READERS start at once, the others with `widen()`
    (fewer large reads in the disk's queue while other small ones must not wait long). LAST: how many of the
    PIECES, at their end, start only once every piece before them has been read (or failed): those before them
    then do not share the disk with them; LAST_READERS: how many threads read those (the others end there, so
    that a read someone waits for meanwhile has fewer large ones ahead of it in the disk's queue)."""

    def __init__(self, what: str, pieces: list[Piece], readers: int, after: "ReadAhead | None" = None,
                 exact: bool = False, first_readers: int | None = None, last: int = 0,
                 last_readers: int | None = None) -> None:
        self.what = what
        self.readers = readers
        self.bytes = sum(length for _, _, length in pieces)
        self.after = after
        self.exact = exact
        self.last = last
        self.started = time.time()
        self.ended: float | None = None
        self.error: str | None = None
        self.done = threading.Event()
        self._pieces = iter(enumerate(pieces))
        self._lock = threading.Lock()
        self._first_last = len(pieces) - last if last > 0 else None  # the index of the first of the LAST pieces
        self._read_before_last = 0
        self._last_readers = min(last_readers or readers, readers)
        self._reading_last = 0  # threads that have taken one of the LAST pieces
        self._all_before_last = threading.Condition(self._lock)
        self._running = self._threads = 0
        self._announced = False  # logging is set up after the read-ahead starts
        self.first_readers = min(readers, first_readers or readers)
        self._add_readers(self.first_readers)

    def widen(self) -> int:
        """Read with all READERS threads from now on: those not started yet start now, unless it has ended.
        Returns how many started."""
        return self._add_readers(self.readers)

    def _add_readers(self, readers: int) -> int:
        with self._lock:
            more = 0 if self.done.is_set() else max(0, readers - self._threads)
            self._threads += more
            self._running += more
        for _ in range(more):
            threading.Thread(target=self._read, name=self.what, daemon=True).start()
        return more

    def _read(self) -> None:
        fds: dict[str, int] = {}
        reads_last = False
        try:
            if self.after is not None:
                self.after.done.wait()
            buffer = bytearray(READ_BYTES)
            while True:
                taken, reads_last = self._take(reads_last)
                if taken is None:
                    return
                index, (path, offset, length) = taken
                if reads_last:
                    with self._all_before_last:
                        self._all_before_last.wait_for(lambda: self._read_before_last >= self._first_last)
                try:
                    if path not in fds:
                        fds[path] = self._open(path)
                    if not self.exact or not piece_cached(fds[path], offset, length):
                        _read_piece(fds[path], offset, offset + length, buffer)
                finally:  # a failed read counts too: nobody waits for a piece that will not come
                    if self._first_last is not None and index < self._first_last:
                        with self._all_before_last:
                            self._read_before_last += 1
                            if self._read_before_last >= self._first_last:
                                self._all_before_last.notify_all()
        except OSError as exc:
            self.error = str(exc)
        finally:
            for fd in fds.values():
                os.close(fd)
            with self._lock:
                self._running -= 1
                self._reading_last -= reads_last  # a thread that failed leaves its place to one still running
                if self._running == 0:
                    self.ended = time.time()
                    self.done.set()
                report = self._running == 0 and self._announced
            if report:
                self.report()

    def _take(self, reads_last: bool) -> tuple[tuple[int, Piece] | None, bool]:
        """The next piece (its index and itself) for a thread, and whether the thread reads the LAST pieces; no
        piece when it is to end: none left, or the next one of the LAST with LAST_READERS threads on them."""
        with self._lock:
            taken = next(self._pieces, None)
            if taken is None or reads_last or self._first_last is None or taken[0] < self._first_last:
                return taken, reads_last
            if self._reading_last >= self._last_readers:
                self._pieces = itertools.chain([taken], self._pieces)  # left to a thread that reads them
                return None, False
            self._reading_last += 1
            return taken, True

    def _open(self, path: str) -> int:
        fd = os.open(path, os.O_RDONLY)
        if self.exact:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)  # this open file reads what it is asked, no more
        return fd

    def announce(self) -> None:
        """Log that it runs, once logging is set up; and how it went, now if it is over, else when it is."""
        from runtime.logs import get_logger

        threads = (f"{self.first_readers} threads, {self.readers} once widened" if self.first_readers < self.readers
                   else f"{self.readers} threads")
        if self._first_last is not None:
            threads += f", the last {self.last} pieces on {self._last_readers}"
        get_logger("read_ahead").info("%s: reading %.2f GiB into the page cache with %s%s", self.what,
                                      self.bytes / 2**30, threads,
                                      f", after the {self.after.what}" if self.after is not None else "")
        with self._lock:
            self._announced = True
            over = self.ended is not None
        if over:
            self.report()

    def report(self) -> None:
        from runtime.logs import get_logger  # imported by the bootstrap long before a read-ahead ends

        seconds = self.ended - self.started
        get_logger("read_ahead").info(
            "%s: %.2f GiB in the page cache %.2f s after it began (%.2f GiB/s)%s", self.what, self.bytes / 2**30,
            seconds, self.bytes / 2**30 / max(seconds, 1e-6), f"; stopped: {self.error}" if self.error else "")

    def join(self, timeout: float | None = None) -> bool:
        """Whether every thread has finished (within TIMEOUT)."""
        return self.done.wait(timeout)


def _read_piece(fd: int, offset: int, end: int, buffer: bytearray) -> None:
    while offset < end:
        n = os.preadv(fd, [memoryview(buffer)[:min(READ_BYTES, end - offset)]], offset)
        if n <= 0:
            return
        offset += n


def piece_pages(fd: int, offset: int, length: int) -> tuple[int, int]:
    """(pages of the piece in the page cache, pages of the piece); none cached where the kernel cannot say."""
    from runtime.weights.residency import cached_pages

    page = os.sysconf("SC_PAGE_SIZE")
    return cached_pages(fd, offset, length) or 0, (offset + length - 1) // page - offset // page + 1


def piece_cached(fd: int, offset: int, length: int) -> bool:
    """Whether every page of the piece is in the page cache (False where the kernel cannot say)."""
    cached, pages = piece_pages(fd, offset, length)
    return cached >= pages
