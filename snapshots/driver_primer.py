"""A short-lived process that initialises the CUDA driver while CRIU restores a process snapshot onto a GPU.

A restored process snapshot holds no CUDA state, so the runtime calls cuInit and makes its context after the
restore, on the way to its first token. On the H100 machine cuInit took 0.10 s in a bare process and 0.18 s
in one that had imported torch, but 0.01 s while another process had run cuInit, with or without a context
(`scripts/probe_cuda_start.py`, docs/benchmarks.md). After the GPU has had no CUDA client for a few seconds,
the first cuInit takes 0.2 s or more and the context that follows is slower too, unless another process
holds the driver initialised by then. So the entry point starts this primer right after CRIU, when it
restores a process snapshot (runtime/entry.py), and a bootstrap that may restore one starts it otherwise
(`snapshots/restore.py: take_over`): its cuInit overlaps CRIU's restore, and it stays for HOLD_S, long past
the restored runtime's own cuInit, then exits. It makes no context, so it holds no GPU memory. It runs
without `site` (the interpreter starts in a few milliseconds) and imports only the driver's ctypes binding.

It is on the way to the start pages' and the weights' first reads, so this module imports only os and sys, and
threading when it starts the primer (their readers need it next).
"""

from __future__ import annotations

import os
import sys

TYPE_CHECKING = False
if TYPE_CHECKING:
    from runtime.config import Settings

#: seconds the primer stays: the restored runtime calls cuInit within a second of the restore
HOLD_S = 3.0
#: the device node that says a GPU driver is there
DRIVER_NODE = "/dev/nvidiactl"
#: the package root, for an interpreter started without `site`
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

#: the primer this process started: one per start, whoever starts it first
_started: int | None = None


def wanted(settings: "Settings") -> bool:
    """Whether this start may restore a process snapshot onto a GPU, and PRIME_DRIVER is on."""
    return (settings.prime_driver and settings.device != "cpu" and settings.snapshot_dir is not None
            and settings.restore in ("auto", "process"))


def start_primer(settings: "Settings") -> int | None:
    """Start the primer where it is `wanted`, unless this start has one already (`start`)."""
    return start() if wanted(settings) else None


def start() -> int | None:
    """Start the primer once per process where a GPU driver is there; returns its pid. It ends by itself,
    and a thread of this process reaps it."""
    global _started
    if _started is None and os.path.exists(DRIVER_NODE):
        import threading

        null = os.open(os.devnull, os.O_RDWR)
        try:
            _started = os.posix_spawn(sys.executable, primer_command(), os.environ,
                                      file_actions=[(os.POSIX_SPAWN_DUP2, null, 0), (os.POSIX_SPAWN_DUP2, null, 1)])
        finally:
            os.close(null)
        threading.Thread(target=_reap, args=(_started,), name="driver primer", daemon=True).start()
    return _started


def _reap(pid: int) -> None:
    try:
        os.waitpid(pid, 0)
    except ChildProcessError:  # a restored runtime's supervisor, which reaps every child, came first
        pass


def primer_command() -> list[str]:
    """The primer's interpreter, without `site`, and the code it runs."""
    code = f"import sys; sys.path.insert(0, {ROOT!r}); from snapshots.driver_primer import main; main()"
    return [sys.executable, "-S", "-c", code]


def main() -> None:
    import time

    from runtime.cuda_driver.device import init_driver

    try:
        init_driver()
    except Exception as exc:  # the restored runtime makes its context anyway, only without the head start
        print(f"driver primer: {exc}", file=sys.stderr)
        sys.exit(1)
    time.sleep(HOLD_S)
