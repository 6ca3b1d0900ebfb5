"""The bootstrap after a CRIU restore: a thin supervisor of the restored runtime.

Why supervise rather than exec: the restored process is not a program that can be exec'd; CRIU creates it
as a child (here of the bootstrap, its subreaper). The bootstrap is the container's pid 1, so it stays: it
forwards SIGTERM/SIGINT (Knative's drain) to the runtime, the one that came during the restore included,
reaps what is orphaned to it, and exits with the runtime's status so the platform sees the real outcome.
"""

from __future__ import annotations

import os
import signal
import time

from runtime.logs import get_logger
from snapshots import stop_during_restore

log = get_logger("snapshots.supervise")

FORWARDED = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1, signal.SIGUSR2)


def supervise(pid: int, lazy_pages: int | None = None, restored_at: float | None = None) -> int:
    """Forward signals to PID until it exits; return its exit status (128 + signal when killed). LAZY_PAGES:
    the pid of the daemon filling PID's memory in since RESTORED_AT, when CRIU's restore returned; if it
    fails, part of that memory never came back, and PID is killed."""

    def forward(signum: int, frame: object) -> None:
        try:
            os.kill(pid, signum)
        except ProcessLookupError:
            pass

    for signum in FORWARDED:
        signal.signal(signum, forward)
    noted = stop_during_restore.take_noted()
    if noted is not None:  # it came while CRIU restored or the hand-over ran: the runtime drains now
        log.info("forwarding %s, which came during the restore", signal.Signals(noted).name)
        forward(noted, None)
    while True:
        try:
            reaped, status = os.waitpid(-1, 0)
        except ChildProcessError:
            return 1
        except InterruptedError:
            continue
        if reaped == pid:
            code = os.waitstatus_to_exitcode(status)
            log.info("the restored runtime exited with %d", code)
            return code if code >= 0 else 128 - code
        if reaped == lazy_pages:
            code = os.waitstatus_to_exitcode(status)
            if code == 0:
                log.info("lazy pages: the restored runtime's memory is all back, %.3f s after CRIU's restore",
                         time.time() - (restored_at or time.time()))
            else:
                log.error("lazy pages: the daemon filling the restored runtime's memory failed (%d): stopping it",
                          code)
                forward(signal.SIGKILL, None)
