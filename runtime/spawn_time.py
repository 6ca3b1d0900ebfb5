"""When this start began: every process of one start (the bootstrap, a runtime restored into it, a benchmark's
child) measures its cold-start timeline from the same spawn time, THAWLLM_SPAWN_TIME where a parent set it.

Imports only what the interpreter has loaded at start: the entry point reads it before anything else.
"""

from __future__ import annotations

import os
import time

#: the spawn time as a parent gives it: wall-clock seconds, repr() of a float
ENV = "THAWLLM_SPAWN_TIME"


def process_start_time(pid: int | None = None) -> float:
    """Wall-clock time at which a process was spawned, from /proc (10 ms resolution)."""
    try:
        with open(f"/proc/{pid or 'self'}/stat", "rb") as f:
            fields = f.read().rsplit(b")", 1)[1].split()
        ticks = int(fields[19])  # field 22, counted after the ") " that ends the command name
        since_boot = time.clock_gettime(time.CLOCK_BOOTTIME) - ticks / os.sysconf("SC_CLK_TCK")
        return time.time() - since_boot
    except (OSError, ValueError, IndexError):
        return time.time()


def spawn_time() -> float:
    """THAWLLM_SPAWN_TIME, else when this process was spawned."""
    spawned = os.environ.get(ENV)
    return float(spawned) if spawned else process_start_time()


def pin_spawn_time() -> None:
    """Put this process's spawn time in its environment unless a parent did: the processes it starts and
    hands over to then agree on it (read once: /proc's answer moves with the clocks)."""
    if not os.environ.get(ENV):
        os.environ[ENV] = repr(process_start_time())
