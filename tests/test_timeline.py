"""What a stage's detail says about the thread that ran it (runtime/timeline.py: thread_usage)."""

import mmap
import os
import threading
import time

import pytest

from runtime.timeline import thread_usage
from runtime.weights.residency import cached_fraction


def test_a_thread_that_works_shows_its_cpu_time_and_one_that_waits_shows_its_waits():
    busy: dict = {}
    with thread_usage(busy, "spin"):  # until this thread has run 0.1 s, however busy the machine is
        until = time.thread_time() + 0.1
        while time.thread_time() < until:
            pass
    idle: dict = {}
    with thread_usage(idle, "sleep"):
        for _ in range(5):
            time.sleep(0.01)
    assert busy["spin_cpu_s"] >= 0.09 and set(busy) == {"spin_cpu_s", "spin_system_s", "spin_faults",
                                                   "spin_disk_faults", "spin_waits", "spin_preempted"}
    assert idle["sleep_cpu_s"] < 0.03 and idle["sleep_waits"] >= 5


def test_only_the_calling_thread_is_counted():
    detail: dict = {}
    stop = threading.Event()

    def spin() -> None:
        while not stop.is_set():
            pass

    other = threading.Thread(target=spin)
    other.start()
    try:
        with thread_usage(detail, "waiting"):
            time.sleep(0.1)
    finally:
        stop.set()
        other.join()
    assert detail["waiting_cpu_s"] < 0.03


def test_pages_read_from_storage_are_told_from_pages_in_the_page_cache(tmp_path):
    path = tmp_path / "pages"
    path.write_bytes(os.urandom(8 << 20))
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)  # written pages are dirty until written back: the kernel keeps those
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        cached = cached_fraction([str(path)])
        if cached is None or cached > 0.5:
            pytest.skip("the page cache cannot be asked, or keeps the file after POSIX_FADV_DONTNEED (tmpfs)")
        touched = {}
        for name in ("cold", "warm"):  # a new mapping each time: the second finds every page in the page cache
            with mmap.mmap(fd, 0, prot=mmap.PROT_READ) as pages, thread_usage(touched, name):
                sum(pages[i] for i in range(0, len(pages), mmap.PAGESIZE))
    finally:
        os.close(fd)
    assert touched["cold_disk_faults"] > 0
    assert touched["warm_disk_faults"] == 0 and touched["warm_faults"] > 0
