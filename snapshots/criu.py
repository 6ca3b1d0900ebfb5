"""CRIU from Python: find the binary, know its version, say whether this machine lets it checkpoint and
restore, and run it (a restore in the background: snapshots/restore_run.py). Every "cannot" is a one-line
reason, shown in the log and at /health."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

from snapshots.restore_run import CRIU_ENV, INSTALLED_CRIU

#: where scripts/install_criu.sh puts its wrapper; $THAWLLM_CRIU first, `criu` on PATH last
INSTALLED = Path(INSTALLED_CRIU)
#: the installed criu's version, written by the install: reading it saves running criu (bash, its own
#: loader, criu) before every restore, 30-80 ms
INSTALLED_VERSION = INSTALLED.parents[1] / "VERSION"
MIN_MAJOR = 4  # 3.x fails `criu check` on 6.x kernels ("Unexpected rt vDSO area bounds")

CAP_SYS_PTRACE = 19
CAP_SYS_ADMIN = 21  # restoring into a new pid namespace creates one
CAP_CHECKPOINT_RESTORE = 40


class CriuError(RuntimeError):
    """criu ran and failed; the message ends with the tail of its log."""


@dataclass(frozen=True)
class Criu:
    path: str
    version: str

    def run(self, args: list[str], log_file: Path, timeout: float = 300.0) -> None:
        """`criu ARGS -o LOG_FILE -v4`; raises CriuError with the log's last lines."""
        command = [self.path, *args, "-o", str(log_file), "-v4"]
        try:
            result = subprocess.run(command, capture_output=True, text=True, timeout=timeout)
        except subprocess.TimeoutExpired:
            raise timed_out(args[0], timeout, log_file) from None
        if result.returncode != 0:
            raise failure(args[0], result.returncode, result.stderr, log_file)


def find_criu() -> Criu | None:
    """The first criu that runs and reports a version: $THAWLLM_CRIU, the installed wrapper, PATH."""
    for candidate in (os.environ.get(CRIU_ENV), str(INSTALLED), shutil.which("criu")):
        if candidate and os.access(candidate, os.X_OK):
            version = (recorded_version(INSTALLED_VERSION, Path(candidate)) if candidate == str(INSTALLED)
                       else None) or criu_version(candidate)
            if version:
                return Criu(candidate, version)
    return None


def recorded_version(record: Path, binary: Path) -> str | None:
    """The version the install wrote into RECORD, if it is there and not older than BINARY."""
    try:
        if record.stat().st_mtime < binary.stat().st_mtime:
            return None
        version = record.read_text().strip()
    except OSError:
        return None
    return version if re.fullmatch(r"\d+(\.\d+)*", version) else None


def criu_version(path: str) -> str | None:
    try:
        out = subprocess.run([path, "--version"], capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.TimeoutExpired):
        return None
    match = re.search(r"Version:\s*(\S+)", out)
    return match.group(1) if match else None


def restore_blockers(criu: Criu | None, pid_namespace: bool = True) -> list[str]:
    """Why CRIU cannot checkpoint or restore in this process's environment: [] when it can. Cheap (reads
    /proc), so it runs at every boot; `criu check` is the thorough, slower test (`check_kernel`)."""
    if criu is None:
        return ["criu is not installed (scripts/install_criu.sh)"]
    reasons = []
    if int(criu.version.split(".")[0]) < MIN_MAJOR:
        reasons.append(f"criu {criu.version} at {criu.path} is older than {MIN_MAJOR}.0")
    if os.environ.get("AWS_LAMBDA_RUNTIME_API"):
        reasons.append("AWS Lambda grants no ptrace or checkpoint/restore capability")
    caps = _effective_caps()
    if not caps >> CAP_SYS_PTRACE & 1:
        reasons.append("missing capability CAP_SYS_PTRACE")
    if pid_namespace and not caps >> CAP_SYS_ADMIN & 1:
        reasons.append("missing capability CAP_SYS_ADMIN (the snapshot restores into a new pid namespace)")
    if not pid_namespace and not caps >> CAP_SYS_ADMIN & 1 and not caps >> CAP_CHECKPOINT_RESTORE & 1:
        reasons.append("missing capability CAP_CHECKPOINT_RESTORE")
    if _status_field("Seccomp") == "2":
        # Docker's default profile refuses several calls CRIU makes (e.g. clone3 with set_tid).
        reasons.append("a seccomp filter is in force (run the container with seccomp=unconfined)")
    return reasons


def check_kernel(criu: Criu) -> str | None:
    """`criu check`: None when the kernel has what CRIU needs, else its complaint."""
    result = subprocess.run([criu.path, "check"], capture_output=True, text=True, timeout=60)
    if result.returncode == 0:
        return None
    return (result.stderr.strip() or result.stdout.strip()).splitlines()[-1]


def _effective_caps() -> int:
    value = _status_field("CapEff")
    return int(value, 16) if value else 0


def _status_field(name: str) -> str | None:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(name + ":"):
                return line.split(":", 1)[1].strip()
    return None


def failure(command: str, returncode: int, stderr: str, log_file: str | Path) -> CriuError:
    """The error of a criu COMMAND that exited RETURNCODE: its first logged error, else its stderr's end."""
    cause = _first_error(log_file) or stderr.strip()[-300:]
    return CriuError(f"criu {command} exited {returncode}: {cause}{_tail(log_file)}")


def timed_out(command: str, timeout: float, log_file: str | Path) -> CriuError:
    return CriuError(f"criu {command} timed out after {timeout:.0f} s{_tail(log_file)}")


def _first_error(log_file: str | Path) -> str:
    """The first error criu logged, without its timestamp and source location: what a one-line reason says
    (e.g. "Can't fork for 856: File exists" when the baked pids are taken). Failing to raise RLIMIT_NOFILE
    is logged as an error but criu goes on, so it is passed over."""
    try:
        text = Path(log_file).read_text(errors="replace").splitlines()
    except OSError:
        return ""
    for line in text:
        _, marker, rest = line.partition("Error (")
        if marker and "rlimit:" not in rest:
            return rest.partition("): ")[2].strip()
    return ""


def _tail(log_file: str | Path, lines: int = 12) -> str:
    try:
        text = Path(log_file).read_text(errors="replace").strip().splitlines()
    except OSError:
        return ""
    errors = [line for line in text if "Error" in line or "error" in line] or text
    return "\n" + "\n".join(errors[-lines:])
