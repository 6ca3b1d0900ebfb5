"""The CUDA checkpoint driver API (cuda-bindings), driven from a helper process: a process cannot
checkpoint its own GPU state. `python -m snapshots.cuda_checkpoint {checkpoint,restore} PID`.

checkpoint: lock (waits for in-flight work; new CUDA calls block), then checkpoint (device memory copied
to host, the GPU released: the process holds no /dev/nvidia* files, so CRIU can dump it).
restore: put the device state back (on this machine's GPU), then unlock. docs/architecture.md, "The CUDA
checkpoint", says what the driver requires.
"""

from __future__ import annotations

import argparse
import select
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

from runtime.logs import get_logger

log = get_logger("snapshots.cuda_checkpoint")

LOCK_TIMEOUT_MS = 60_000
#: the helper's line on stdout once the restored process's CUDA state is back and unlocked
RESTORED = "restored"


class CudaCheckpointError(RuntimeError):
    pass


def checkpoint(pid: int) -> None:
    from cuda.bindings import driver

    _init(driver)
    lock = driver.CUcheckpointLockArgs()
    lock.timeoutMs = LOCK_TIMEOUT_MS
    _check(driver.cuCheckpointProcessLock(pid, lock), "cuCheckpointProcessLock")
    _check(driver.cuCheckpointProcessCheckpoint(pid, driver.CUcheckpointCheckpointArgs()),
           "cuCheckpointProcessCheckpoint")
    expect_state(driver, pid, driver.CUprocessState.CU_PROCESS_STATE_CHECKPOINTED)


def restore(pid: int) -> None:
    from cuda.bindings import driver

    _init(driver)
    _check(driver.cuCheckpointProcessRestore(pid, driver.CUcheckpointRestoreArgs()),
           "cuCheckpointProcessRestore")
    _check(driver.cuCheckpointProcessUnlock(pid, driver.CUcheckpointUnlockArgs()),
           "cuCheckpointProcessUnlock")
    expect_state(driver, pid, driver.CUprocessState.CU_PROCESS_STATE_RUNNING)


def expect_state(driver, pid: int, wanted) -> None:
    err, state = driver.cuCheckpointProcessGetState(pid)
    _check((err,), "cuCheckpointProcessGetState")
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
    work. With WEIGHTS (a layout directory) it also streams the weights meanwhile, into memory it hands to the
    restored process through `channel`, the socket the handoff passes on (snapshots/weights_during_restore.py).
    Without CUDA_RESTORE (a process snapshot, which holds no CUDA state) it only streams the weights.

    `close()` stops a helper whose restore failed; `detach()` lets one that restored finish its handover."""

    def __init__(self, weights: Path | None = None, cuda_restore: bool = True, memory_first: bool = True,
                 embedding_last: bool = False) -> None:
        if not cuda_restore and weights is None:
            raise ValueError("a helper that restores no CUDA state has only the weights to stream")
        self.restores_cuda = cuda_restore
        command = ([sys.executable, "-m", "snapshots.cuda_checkpoint", "restore", "-"] if cuda_restore
                   else [sys.executable, "-m", "snapshots.weights_during_restore"])
        self.channel: socket.socket | None = None
        ours = None
        if weights is not None:
            ours, self.channel = socket.socketpair()
            command += ["--weights", str(weights), "--channel-fd", str(ours.fileno())]
            if not memory_first:
                command.append("--memory-after-stream")
            if embedding_last:
                command.append("--embedding-last")
        self._proc = subprocess.Popen(command, stdin=subprocess.PIPE if cuda_restore else subprocess.DEVNULL,
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                      pass_fds=(ours.fileno(),) if ours is not None else ())
        if ours is not None:
            ours.close()

    def restore(self, pid: int, timeout: float = 600.0) -> float:
        """Restore and unlock PID's CUDA state; returns the seconds it took."""
        started = time.time()
        try:
            self._proc.stdin.write(f"{pid}\n")
            self._proc.stdin.close()
        except OSError:
            pass  # it has exited already: its status says why
        ready, _, _ = select.select([self._proc.stdout], [], [], timeout)
        line = self._proc.stdout.readline().strip() if ready else None
        if line != RESTORED:
            self.close()
            if line is None:
                raise CudaCheckpointError(f"cuda restore of pid {pid} did not finish in {timeout:.0f} s")
            raise CudaCheckpointError(f"cuda restore of pid {pid} failed: {self._proc.stderr.read().strip()[-500:]}")
        return time.time() - started

    def detach(self) -> None:
        """The restore is done; the helper goes on until its weights are handed over. Its messages are logged."""
        if self.channel is not None:
            self.channel.close()  # the restored process has its own copy now

        def drain() -> None:
            for line in self._proc.stderr:
                log.warning("cuda restore helper: %s", line.rstrip())
            try:
                self._proc.wait()
            except ChildProcessError:
                pass  # reaped by the supervisor (snapshots/supervise.py)

        threading.Thread(target=drain, name="cuda-restore-helper", daemon=True).start()

    def close(self) -> None:
        if self.channel is not None:
            self.channel.close()
        if self._proc.poll() is None:
            self._proc.kill()
            self._proc.wait()


def _init(driver) -> None:
    _check(driver.cuInit(0), "cuInit")


def _check(result: tuple, name: str) -> None:
    """As runtime.cuda_driver.call, in this module's error type (the bootstrap reports it as the reason)."""
    from runtime.cuda_driver import DriverError, call

    try:
        call(result[:1], name)
    except DriverError as exc:
        raise CudaCheckpointError(str(exc)) from None


def _restore_from_stdin(weights: Path | None, channel_fd: int | None, memory_first: bool = True) -> None:
    """The helper's side of RestoreHelper: cuInit, start streaming WEIGHTS (if any), then restore the pid the
    bootstrap sends once CRIU has restored it, say so, and finish the weights' handover."""
    from cuda.bindings import driver

    _init(driver)
    handover = None
    if weights is not None:
        from snapshots.weights_during_restore import stream_for_handover

        channel = socket.socket(fileno=channel_fd)
        handover = threading.Thread(target=stream_for_handover, args=(weights, channel, memory_first),
                                    daemon=True)
        handover.start()
    line = sys.stdin.readline().strip()
    if not line:  # the bootstrap gave up before there was a process to restore
        return
    restore(int(line))
    print(RESTORED, flush=True)
    if handover is not None:
        handover.join()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(prog="snapshots.cuda_checkpoint")
    parser.add_argument("action", choices=("checkpoint", "restore"))
    parser.add_argument("pid", help="the process, or - to initialise CUDA first and then read it from stdin")
    parser.add_argument("--weights", type=Path, help="restore -: a layout to stream while CRIU restores")
    parser.add_argument("--channel-fd", type=int, help="restore -: the socket to hand the weights over on")
    parser.add_argument("--memory-after-stream", action="store_true",
                        help="restore -: hand the weights' memory over with the stream's report")
    args = parser.parse_args()
    try:
        if args.pid == "-":
            _restore_from_stdin(args.weights, args.channel_fd, not args.memory_after_stream)
        else:
            {"checkpoint": checkpoint, "restore": restore}[args.action](int(args.pid))
    except CudaCheckpointError as exc:
        print(f"cuda_checkpoint: {exc}", file=sys.stderr)
        sys.exit(1)
