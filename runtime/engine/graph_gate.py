"""When the graph work left for after ready (materialised restores) may touch the model's memory.

That work loads its kernels by running the model's first layers on inputs of its own: it reads the weights
and writes KV block 0. A multi-model pool may give an idle model's weights or KV cache back meanwhile. So the
work runs in pieces, each entered through the gate; the pool `hold`s the gate before giving memory back (it
waits for the piece in progress, whose kernels the unmap's device synchronise then waits for) and `release`s
it once the model is resident again. An eviction waits for one piece, not for the whole work.
"""

from __future__ import annotations

import threading


class GraphWorkStopped(BaseException):
    """The engine shut down while its graph work waited for memory to come back. Not an Exception: it is no
    failure of the work, so what handles those (logging, falling back) lets it through."""


class GraphGate:
    def __init__(self) -> None:
        self._lock = threading.Lock()  # held by the graph work during a piece
        self._memory = threading.Event()  # the model's memory is there
        self._memory.set()
        self._stopped = False
        self._entered = False  # touched by the graph work's thread only

    # -- the graph work's thread ------------------------------------------------------------------

    def enter(self) -> None:
        """Before a piece: wait until the memory is there and no eviction holds the gate."""
        self.leave()
        while True:
            self._memory.wait()
            if self._stopped:
                raise GraphWorkStopped
            self._lock.acquire()
            if self._memory.is_set() and not self._stopped:
                self._entered = True
                return
            self._lock.release()

    def leave(self) -> None:
        """After a piece (and before waiting between pieces)."""
        if self._entered:
            self._entered = False
            self._lock.release()

    # -- the pool and the engine's shutdown --------------------------------------------------------

    def hold(self) -> None:
        """The model's memory is about to go: returns once no piece runs, and none starts until `release`."""
        with self._lock:
            self._memory.clear()

    def release(self) -> None:
        """The model's memory is back."""
        self._memory.set()

    def stop(self) -> None:
        """The engine shuts down: a piece waiting for memory gives up."""
        self._stopped = True
        self._memory.set()
