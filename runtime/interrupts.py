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
"""

from __future__ import annotations

import os
import signal
import sys
import threading
from types import CodeType, FrameType

_POKE = signal.SIGUSR1


def sigterm_interrupts_main() -> None:
    """Install the handlers; call once, from the main thread."""
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
                while not raised.is_set():
                    signal.pthread_kill(main, _POKE)
                    raised.wait(0.05)

    threading.Thread(target=watch, name="signal-watcher", daemon=True).start()


def _inside(frame: FrameType | None, code: CodeType) -> bool:
    """Whether FRAME or a frame that called it runs CODE."""
    while frame is not None:
        if frame.f_code is code:
            return True
        frame = frame.f_back
    return False
