"""The CUDA checkpoint driver API (cuda-bindings), driven from a helper process: a process cannot
checkpoint its own GPU state. `python -m snapshots.cuda_checkpoint {checkpoint,restore} PID`.

checkpoint: lock (waits for in-flight work; new CUDA calls block), then checkpoint (device memory copied
to host, the GPU released: the process holds no /dev/nvidia* files, so CRIU can dump it).
restore: put the device state back (on this machine's GPU), then unlock. See GPU-FACTS.md for the flow and
its figures on the H100.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time

LOCK_TIMEOUT_MS = 60_000


class CudaCheckpointError(RuntimeError):
    pass


def checkpoint(pid: int) -> None:
    from cuda.bindings import driver

    _init(driver)
    lock = driver.CUcheckpointLockArgs()
    lock.timeoutMs = LOCK_TIMEOUT_MS
    _check(driver, driver.cuCheckpointProcessLock(pid, lock), "cuCheckpointProcessLock")
    _check(driver, driver.cuCheckpointProcessCheckpoint(pid, driver.CUcheckpointCheckpointArgs()),
           "cuCheckpointProcessCheckpoint")
    expect_state(driver, pid, driver.CUprocessState.CU_PROCESS_STATE_CHECKPOINTED)


def restore(pid: int) -> None:
    from cuda.bindings import driver

    _init(driver)
    _check(driver, driver.cuCheckpointProcessRestore(pid, driver.CUcheckpointRestoreArgs()),
           "cuCheckpointProcessRestore")
    _check(driver, driver.cuCheckpointProcessUnlock(pid, driver.CUcheckpointUnlockArgs()),
           "cuCheckpointProcessUnlock")
    expect_state(driver, pid, driver.CUprocessState.CU_PROCESS_STATE_RUNNING)


def expect_state(driver, pid: int, wanted) -> None:
    err, state = driver.cuCheckpointProcessGetState(pid)
    _check(driver, (err,), "cuCheckpointProcessGetState")
    if state != wanted:
        raise CudaCheckpointError(f"process {pid} is {state.name}, expected {wanted.name}")


def run_helper(action: str, pid: int, timeout: float = 600.0) -> float:
    """Run ACTION on PID in a helper process (keeps CUDA out of the caller); returns seconds taken."""
    started = time.time()
    result = subprocess.run([sys.executable, "-m", "snapshots.cuda_checkpoint", action, str(pid)],
                            capture_output=True, text=True, timeout=timeout)
    if result.returncode != 0:
        raise CudaCheckpointError(f"cuda {action} of pid {pid} failed: {result.stderr.strip()[-500:]}")
    return time.time() - started


class RestoreHelper:
    """The CUDA half of a gpu restore, in a helper started before CRIU runs: its Python start, imports and
    cuInit (a few tenths of a second) overlap the CRIU restore, and `restore(pid)` costs only the driver's
    work. `close()` stops a helper that was never given a pid (the CRIU restore failed)."""

    def __init__(self) -> None:
        self._proc = subprocess.Popen([sys.executable, "-m", "snapshots.cuda_checkpoint", "restore", "-"],
                                      stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                      text=True)

    def restore(self, pid: int, timeout: float = 600.0) -> float:
        """Restore and unlock PID's CUDA state; returns the seconds it took."""
        started = time.time()
        try:
            _, err = self._proc.communicate(f"{pid}\n", timeout=timeout)
        except subprocess.TimeoutExpired:
            self.close()
            raise CudaCheckpointError(f"cuda restore of pid {pid} did not finish in {timeout:.0f} s") from None
        if self._proc.returncode != 0:
            raise CudaCheckpointError(f"cuda restore of pid {pid} failed: {err.strip()[-500:]}")
        return time.time() - started

    def close(self) -> None:
        if self._proc.poll() is None:
            self._proc.kill()
            self._proc.wait()


def _init(driver) -> None:
    _check(driver, driver.cuInit(0), "cuInit")


def _check(driver, result: tuple, call: str) -> None:
    err = result[0]
    if err != driver.CUresult.CUDA_SUCCESS:
        _, name = driver.cuGetErrorName(err)
        raise CudaCheckpointError(f"{call}: {name.decode() if isinstance(name, bytes) else name}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(prog="snapshots.cuda_checkpoint")
    parser.add_argument("action", choices=("checkpoint", "restore"))
    parser.add_argument("pid", help="the process, or - to initialise CUDA first and then read it from stdin")
    args = parser.parse_args()
    try:
        if args.pid == "-":
            from cuda.bindings import driver

            _init(driver)
            line = sys.stdin.readline().strip()
            if not line:  # the bootstrap gave up before there was a process to restore
                sys.exit(0)
            args.pid = line
        {"checkpoint": checkpoint, "restore": restore}[args.action](int(args.pid))
    except CudaCheckpointError as exc:
        print(f"cuda_checkpoint: {exc}", file=sys.stderr)
        sys.exit(1)
