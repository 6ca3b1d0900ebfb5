"""SIGTERM and SIGINT while a start restores a CRIU snapshot: noted, and acted on once the restore is handed
over or undone.

Stopped by the signal's default action midway, the bootstrap would leave what CRIU restored running with
nobody to hand it an instance or supervise it: a process that holds the snapshot's handoff name, so that a
later restore of that snapshot in the network namespace fails, until it finds no restorer and exits
(snapshots/handoff.py), and the platform's stop would never reach a runtime that drains. So from the entry
point's first step (runtime/entry.py) until the restore's outcome is known, the two signals are only noted.
After a hand-over the supervisor forwards the noted one to the restored runtime, which drains and exits
(snapshots/supervise.py); without one the bootstrap exits with 128 + the signal instead of starting fresh
(runtime/bootstrap.py).

Imports only `_signal`, which every interpreter has loaded at start: this is on the way to CRIU's first
instruction (the `signal` module would import `enum`).
"""

from __future__ import annotations

import _signal

STOPS = (_signal.SIGTERM, _signal.SIGINT)

#: each stop signal's handler before `hold`, while they are held
_previous: dict[int, object] = {}
_noted: int | None = None


def _note(signum: int, frame: object) -> None:
    global _noted
    if _noted is None:
        _noted = signum


def hold() -> None:
    """From now on SIGTERM and SIGINT are noted rather than acted on (again: a no-op). Main thread only."""
    if _previous:
        return
    for signum in STOPS:
        _previous[signum] = _signal.getsignal(signum)
        _signal.signal(signum, _note)


def take_noted() -> int | None:
    """The stop signal that came while they were held, if one did; it is noted only once."""
    global _noted
    noted, _noted = _noted, None
    return noted


def release() -> int | None:
    """Give SIGTERM and SIGINT their handlers from before `hold` back; returns `take_noted()`."""
    while _previous:
        signum, handler = _previous.popitem()
        _signal.signal(signum, handler)
    return take_noted()
