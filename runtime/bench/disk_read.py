"""The disk's parallel read rate over a model's files: what a start from cold disk is held against; and what a
start read from the machine's disks.

`read_files` is the plain parallel read (N threads, preadv of 64 MiB pieces into reused buffers, the data
thrown away); a `DiskRead` reads the files once per thread count it tries, each from a dropped page cache, as
often as it is asked: `faas-bench coldstart` asks before each round of starts. In six rounds on one GPU
machine the disk read the same layout in 7.8-9.5 s on 8 threads and 8.2-10.5 s on 16: one read is no rate to
hold a median of starts against. The reference is the fastest thread count's median, and each start is also held
against the fastest read of its own round.

`bytes_read_from_disks` is the kernel's count of bytes read from the machine's physical disks: taken before
and after a start, everything the start read (its weights, CRIU's image, the libraries' pages), and whatever
else the machine read meanwhile."""

from __future__ import annotations

import os
import statistics
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from runtime.bench.page_cache import drop_page_cache, files_under

MiB, GiB = 1 << 20, 1 << 30
_DISKSTATS = Path("/proc/diskstats")
_BLOCK = Path("/sys/block")
SECTOR = 512  # /proc/diskstats counts 512-byte sectors whatever the disk's own
PIECE_BYTES = 64 * MiB
#: thread counts tried: on the H100 machine's disk 8 read fastest and 16 was 15% slower (one measurement)
THREAD_COUNTS = (8, 16)

_pools: dict[int, ThreadPoolExecutor] = {}  # kept across calls, and so are their buffers: no page faults timed
_buffers = threading.local()


def read_files(paths: list[Path], threads: int = 16, piece: int = PIECE_BYTES) -> int:
    """Read every byte of PATHS with THREADS threads at once; returns the bytes read."""
    pool = _pools.setdefault(threads, ThreadPoolExecutor(threads, thread_name_prefix="disk-read"))
    fds = {p: os.open(p, os.O_RDONLY) for p in paths}

    def read(job: tuple[Path, int]) -> int:
        path, offset = job
        if getattr(_buffers, "size", 0) != piece:
            _buffers.buf, _buffers.size = bytearray(piece), piece
        return os.preadv(fds[path], [_buffers.buf], offset)

    try:
        jobs = [(p, offset) for p in paths for offset in range(0, p.stat().st_size, piece)]
        return sum(pool.map(read, jobs))
    finally:
        for fd in fds.values():
            os.close(fd)


@dataclass
class DiskRead:
    """Reads of every file under `root` (`bytes` in all) from cold disk: the seconds of each, per thread count,
    in the order they were made."""

    root: Path
    bytes: int
    thread_counts: tuple[int, ...] = THREAD_COUNTS
    seconds: dict[int, list[float]] = field(default_factory=dict)

    @classmethod
    def of(cls, root: Path, thread_counts: tuple[int, ...] = THREAD_COUNTS) -> "DiskRead":
        return cls(root, sum(p.stat().st_size for p in files_under(root)), thread_counts)

    def read_once(self) -> str | None:
        """Read the files once with each thread count, the page cache dropped before each; returns why not
        where it cannot be dropped (not root)."""
        files = files_under(self.root)
        for threads in self.thread_counts:
            why_not = drop_page_cache()
            if why_not:
                return why_not
            started = time.perf_counter()
            read_files(files, threads)
            self.seconds.setdefault(threads, []).append(time.perf_counter() - started)
        return None

    @property
    def medians(self) -> dict[int, float]:
        return {threads: statistics.median(reads) for threads, reads in self.seconds.items()}

    @property
    def best_s(self) -> float:
        """The fastest thread count's median."""
        return min(self.medians.values())

    @property
    def best_gib_s(self) -> float:
        return self.bytes / self.best_s / GiB

    def latest_best_s(self) -> float:
        """The fastest of the latest read with each thread count: the reference of the round just read."""
        return min(reads[-1] for reads in self.seconds.values())

    def as_dict(self) -> dict:
        return {"bytes": self.bytes, "reads_by_threads": {str(k): [round(s, 4) for s in v]
                                                          for k, v in self.seconds.items()},
                "seconds_by_threads": {str(k): round(v, 4) for k, v in self.medians.items()},
                "best_s": round(self.best_s, 4), "best_gib_s": round(self.best_gib_s, 3)}

    def summary(self) -> str:
        def reads(times: list[float]) -> str:
            return (f"{times[0]:.2f} s" if len(times) == 1 else
                    f"{statistics.median(times):.2f} s (median of {len(times)}, {min(times):.2f}-{max(times):.2f})")

        tried = ", ".join(f"{n} threads {reads(times)}" for n, times in self.seconds.items())
        return (f"reading the model's {self.bytes / GiB:.2f} GiB from cold disk: {tried} "
                f"(best {self.best_gib_s:.2f} GiB/s)")


@dataclass(frozen=True)
class DiskStats:
    """The physical disks' counters, summed: since boot, but `in_flight`, which is now."""

    reads: int  # read requests completed
    sectors: int  # 512-byte sectors read
    in_flight: int  # requests issued and not yet completed
    busy_ms: int  # time with at least one request in flight


def physical_disk_stats() -> DiskStats | None:
    """The counters of the machine's physical disks (those in /sys/block with a device behind them: not
    partitions, loop, zram or device-mapper devices, whose reads a physical disk counts again); None where the
    kernel does not say."""
    try:
        lines = _DISKSTATS.read_text().splitlines()
    except OSError:
        return None
    reads = sectors = in_flight = busy = 0
    for line in lines:
        fields = line.split()
        if len(fields) > 12 and (_BLOCK / fields[2] / "device").exists():
            reads, sectors = reads + int(fields[3]), sectors + int(fields[5])
            in_flight, busy = in_flight + int(fields[11]), busy + int(fields[12])
    return DiskStats(reads, sectors, in_flight, busy)


def bytes_read_from_disks() -> int | None:
    """Bytes read from the machine's physical disks since boot; None where the kernel does not say."""
    stats = physical_disk_stats()
    return None if stats is None else stats.sectors * SECTOR
