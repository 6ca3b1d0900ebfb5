"""A short-lived process that makes a CUDA context while CRIU restores a process snapshot on a GPU.

A restored process snapshot holds no CUDA state, so the runtime calls cuInit and makes its context after the
restore, on the way to its first token. On the H100 machine cuInit took 0.10 s in a bare process and 0.18 s
in one that had imported torch, but 0.01 s while another process held a context on the GPU
(`scripts/probe_cuda_start.py`, docs/benchmarks.md). So the bootstrap starts this primer just before CRIU
runs: its own start, cuInit and context overlap the restore, and it holds the context for HOLD_S (long past
the restored runtime's own cuInit), then exits, freeing the context's memory. A restore helper that streams the weights (snapshots/weights_during_restore.py) holds a context too,
so no primer is started beside one.

    python -m snapshots.driver_primer INDEX      # the GPU's index among the visible ones
"""

from __future__ import annotations

import subprocess
import sys
import time

#: seconds the primer holds its context: the restored runtime makes its own within a second of the restore
HOLD_S = 3.0


class DriverPrimer:
    """The bootstrap's handle on a primer process; a restore helper that restores nothing and streams nothing
    (snapshots/process.py: `thaw` detaches it once the restore is handed over, closes it if the restore failed)."""

    restores_cuda = False
    channel = None

    def __init__(self, index: int) -> None:
        self._proc = subprocess.Popen([sys.executable, "-m", "snapshots.driver_primer", str(index)],
                                      stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL)

    def detach(self) -> None:
        """Leave it to end by itself after HOLD_S; the supervisor reaps it (snapshots/supervise.py)."""

    def close(self) -> None:
        if self._proc.poll() is None:
            self._proc.kill()
            self._proc.wait()


def device_index(device: str) -> int:
    """0 for "cuda", N for "cuda:N"."""
    return int(device.split(":")[1]) if ":" in device else 0


def main() -> None:
    from runtime.cuda_driver.device import create_primary_context

    try:
        create_primary_context(int(sys.argv[1]))
    except Exception as exc:  # the restored runtime makes its context anyway, only without the head start
        print(f"driver primer: {exc}", file=sys.stderr)
        sys.exit(1)
    time.sleep(HOLD_S)


if __name__ == "__main__":
    main()
