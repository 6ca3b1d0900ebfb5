"""SIGTERM as Ctrl-C for a command-line tool (faas-build): the main thread unwinds through every clean-up.

A process-directed signal goes to any thread that does not block it, and CPython runs the Python handler
only in the main thread, between bytecodes. Delivered to one of torch's or a thread pool's threads while the
main thread waits in a system call (a recv() from an S3 endpoint that never answers), the handler would not
run until that call returned, minutes later. So a watcher thread learns of every signal through the wakeup
fd and pokes the main thread with SIGUSR1 (whose handler does nothing): the interrupted call returns EINTR,
CPython runs the pending handlers, and the SIGTERM handler raises KeyboardInterrupt (once: a second signal
must not interrupt the clean-up the first one started). A poke that lands just before the main thread enters
its system call interrupts nothing, so the watcher pokes again every 50 ms until the handler has run.
"""

from __future__ import annotations

import os
import signal
import threading

_POKE = signal.SIGUSR1


def sigterm_interrupts_main() -> None:
    """Install the handlers; call once, from the main thread."""
    raised = threading.Event()

    def interrupt(signum: int, frame: object) -> None:
        if not raised.is_set():
            raised.set()
            raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, interrupt)
    signal.signal(signal.SIGINT, interrupt)
    signal.signal(_POKE, lambda signum, frame: None)
    read_end, write_end = os.pipe()
    os.set_blocking(write_end, False)
    signal.set_wakeup_fd(write_end, warn_on_full_buffer=False)
    main = threading.main_thread().ident

    def watch() -> None:
        while True:
            signums = os.read(read_end, 64)
            if any(s in (signal.SIGTERM, signal.SIGINT) for s in signums):
                while not raised.is_set():
                    signal.pthread_kill(main, _POKE)
                    raised.wait(0.05)

    threading.Thread(target=watch, name="signal-watcher", daemon=True).start()
