"""SIGTERM as Ctrl-C for a command-line tool (faas-build): the main thread unwinds through every clean-up.

A process-directed signal goes to any thread that does not block it, and CPython runs the Python handler
only in the main thread, between bytecodes. Delivered to one of torch's or a thread pool's threads while the
main thread waits in a system call (a recv() from an S3 endpoint that never answers), the handler would not
run until that call returned, minutes later. So a watcher thread learns of every signal through the wakeup
fd and pokes the main thread with SIGUSR1: the interrupted call returns EINTR, CPython runs the pending
handlers, and the handler raises KeyboardInterrupt (once: a second signal must not interrupt the clean-up the
first one started). A poke that lands just before the main thread enters
its system call interrupts nothing, so the watcher pokes again every 50 ms until the handler has run.

The handler runs wherever the main thread is between bytecodes, and that may be where CPython drops what is
raised: a finalizer (a socket's `__del__`, run by the garbage collector), a weakref's callback (the import
system's module locks have one). There the KeyboardInterrupt goes to `sys.unraisablehook` instead of up the
stack, and the build would go on. So the hook takes a dropped interrupt back: it is asked for again, and the
watcher's next poke raises it, until one lands where it unwinds the main thread. Never while the hook runs: what
is raised in the hook is dropped without a second call of it, and the interrupt would be lost for good.

C code can drop it without a report: a C function that calls Python code and clears whatever error comes back
(`PyDict_GetItem` does, for a key's `__eq__`). So once it has raised, the watcher looks at the main thread every
0.1 s until the tool's main body has ended: an exception being handled there is the interrupt's way out (a
`finally`, an `except`, an `__exit__` running its clean-up); none twice in a row, and the interrupt was dropped,
so it is asked for again.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
from contextlib import contextmanager
from types import CodeType, FrameType
from typing import Iterator

_POKE = signal.SIGUSR1
#: how often the watcher looks for the interrupt's way out once it has been raised
_LOOK_S = 0.1


@contextmanager
def sigterm_interrupts_main() -> Iterator[None]:
    """Install the handlers for the tool's main body, which runs inside; enter once, from the main thread."""
    ended = threading.Event()
    _install(ended)
    try:
        yield
    finally:
        ended.set()


def _install(ended: threading.Event) -> None:
    requested, raised = threading.Event(), threading.Event()

    def interrupt(signum: int, frame: FrameType | None) -> None:
        """SIGTERM or SIGINT, or the watcher's poke: raises once an interrupt is asked for."""
        if signum != _POKE:
            requested.set()
        if requested.is_set() and not raised.is_set() and not _inside(frame, take_back.__code__):
            raised.set()
            raise KeyboardInterrupt

    for signum in (signal.SIGTERM, signal.SIGINT, _POKE):
        signal.signal(signum, interrupt)
    read_end, write_end = os.pipe()
    os.set_blocking(write_end, False)
    signal.set_wakeup_fd(write_end, warn_on_full_buffer=False)
    main = threading.main_thread().ident
    report_unraisable = sys.unraisablehook

    def take_back(unraisable: "sys.UnraisableHookArgs") -> None:
        if raised.is_set() and unraisable.exc_type is not None and issubclass(unraisable.exc_type, KeyboardInterrupt):
            raised.clear()
            os.write(write_end, bytes([signal.SIGTERM]))  # the watcher pokes again, as for the signal itself
            return
        report_unraisable(unraisable)

    sys.unraisablehook = take_back

    def watch() -> None:
        while True:
            signums = os.read(read_end, 64)
            if any(s in (signal.SIGTERM, signal.SIGINT) for s in signums):
                while not ended.is_set():
                    while not raised.is_set():
                        signal.pthread_kill(main, _POKE)
                        raised.wait(0.05)
                    if _dropped(main, ended):
                        raised.clear()

    threading.Thread(target=watch, name="signal-watcher", daemon=True).start()


def _dropped(main: int, ended: threading.Event) -> bool:
    """Whether the main thread handled no exception at two looks _LOOK_S apart while its body had not ended."""
    for _ in range(2):
        if ended.wait(_LOOK_S) or _handling(main):
            return False
    return True


def _handling(thread: int) -> bool:
    """Whether THREAD is handling an exception (or is gone); Python 3.11 gives (type, value, traceback)."""
    current = sys._current_exceptions()
    if thread not in current:
        return True
    exc = current[thread]
    return (exc[0] if isinstance(exc, tuple) else exc) is not None


def _inside(frame: FrameType | None, code: CodeType) -> bool:
    """Whether FRAME or a frame that called it runs CODE."""
    while frame is not None:
        if frame.f_code is code:
            return True
        frame = frame.f_back
    return False
