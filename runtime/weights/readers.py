"""The loader's reader threads, kept for the life of the process and started before the load.

Started by the load itself, sixteen threads took 8 ms (Qwen2-1.5B) to 18 ms (Llama-3-8B) to come up on the
H100 machine: each `Thread.start` waits for its thread to take the GIL, which the readers already running
hold between reads. For a 76 ms load that ramp was several percent of its time. `LayoutLoader` starts the
threads when it is made (runtime/launch.py makes it before `Engine.build`, while no reader runs), and a load
hands each of them a job.
"""

from __future__ import annotations

import queue
import threading
from typing import Callable

from runtime.logs import get_logger

log = get_logger("weights.readers")


class Jobs:
    """The jobs of one `ReaderPool.run`: `wait()` returns when all of them have returned."""

    def __init__(self, n: int) -> None:
        self._left = n
        self._lock = threading.Lock()
        self._done = threading.Event()
        if n == 0:
            self._done.set()

    def one_returned(self) -> None:
        with self._lock:
            self._left -= 1
            if self._left == 0:
                self._done.set()

    def wait(self, timeout: float | None = None) -> bool:
        return self._done.wait(timeout)


class ReaderPool:
    """Threads that each run one job at a time. `run` never queues a job behind another load's: it first
    starts threads until enough are idle, so two loads in flight at once each get all their readers."""

    def __init__(self, name: str = "weights-reader") -> None:
        self._name = name
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._threads: list[threading.Thread] = []
        self._busy = 0

    @property
    def size(self) -> int:
        return len(self._threads)

    def start(self, idle: int) -> None:
        """Have at least `idle` threads waiting for a job."""
        with self._lock:
            self._grow(idle)

    def run(self, job: Callable[[], None], n: int) -> Jobs:
        """Run `job` on `n` threads at once."""
        jobs = Jobs(n)
        with self._lock:
            self._grow(n)
            self._busy += n
        for _ in range(n):
            self._jobs.put((job, jobs))
        return jobs

    def _grow(self, idle: int) -> None:
        while len(self._threads) - self._busy < idle:
            thread = threading.Thread(target=self._serve, name=f"{self._name}-{len(self._threads)}", daemon=True)
            thread.start()
            self._threads.append(thread)

    def _serve(self) -> None:
        while True:
            job, jobs = self._jobs.get()
            try:
                job()
            except Exception:  # a job reports its own errors; one that did not must not end the thread
                log.exception("%s: a job raised", threading.current_thread().name)
            finally:
                with self._lock:
                    self._busy -= 1
                jobs.one_returned()
                # a thread waiting for its next job must not keep this one's load alive: the job is a
                # stream's method, and the stream holds the buffer it filled (the whole weights)
                del job, jobs


#: the process's reader threads, shared by every load
READERS = ReaderPool()
