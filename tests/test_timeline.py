"""What a stage's detail says about the thread that ran it (runtime/timeline.py: thread_usage)."""

import threading
import time

from runtime.timeline import thread_usage


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
    assert busy["spin_cpu_s"] >= 0.09 and set(busy) == {"spin_cpu_s", "spin_system_s", "spin_faults", "spin_waits",
                                                   "spin_preempted"}
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
