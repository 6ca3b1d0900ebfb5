"""A short-lived process that initialises the CUDA driver while CRIU restores a process snapshot onto a GPU.

A restored process snapshot holds no CUDA state, so the runtime calls cuInit and makes its context after the
restore, on the way to its first token. On the H100 machine cuInit took 0.10 s in a bare process and 0.18 s
in one that had imported torch, but 0.01 s while another process had run cuInit, with or without a context
(`scripts/probe_cuda_start.py`, docs/benchmarks.md). So a bootstrap that may restore a snapshot onto a GPU
starts this primer first thing (`snapshots/restore.py: take_over`): its start and cuInit overlap the
bootstrap's checks and CRIU's restore, and it stays for HOLD_S, long past the restored runtime's own cuInit,
then exits. It makes no context, so it holds no GPU memory. It runs without `site` (the interpreter starts
in a few milliseconds) and imports only the driver's ctypes binding.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from runtime.config import Settings

#: seconds the primer stays: the restored runtime calls cuInit within a second of the restore
HOLD_S = 3.0
#: the package root, for an interpreter started without `site`
ROOT = str(Path(__file__).resolve().parents[1])


def wanted(settings: "Settings") -> bool:
    """Whether this start may restore a process snapshot onto a GPU, and PRIME_DRIVER is on."""
    return (settings.prime_driver and settings.device != "cpu" and settings.snapshot_dir is not None
            and settings.restore in ("auto", "process"))


def start_primer(settings: "Settings") -> subprocess.Popen | None:
    """Start a primer where it is `wanted` and a GPU driver is there; it ends by itself, and the bootstrap, as
    the restored runtime's supervisor, reaps it (snapshots/supervise.py)."""
    if not wanted(settings) or not os.path.exists("/dev/nvidiactl"):
        return None
    return subprocess.Popen(primer_command(), stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL)


def primer_command() -> list[str]:
    """The primer's interpreter, without `site`, and the code it runs."""
    code = f"import sys; sys.path.insert(0, {ROOT!r}); from snapshots.driver_primer import main; main()"
    return [sys.executable, "-S", "-c", code]


def main() -> None:
    from runtime.cuda_driver.device import init_driver

    try:
        init_driver()
    except Exception as exc:  # the restored runtime makes its context anyway, only without the head start
        print(f"driver primer: {exc}", file=sys.stderr)
        sys.exit(1)
    time.sleep(HOLD_S)
