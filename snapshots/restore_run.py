"""`criu restore` running in the background: started, then waited for. Every restore of a CRIU snapshot goes
through `RestoreRun` (snapshots/checkpoint.py: `restore`), the one the entry point starts before the
bootstrap's imports too (snapshots/early_restore.py), so this module imports only what the interpreter has
already loaded at start: it is on the way to CRIU's first instruction.
"""

from __future__ import annotations

import os
import time

TYPE_CHECKING = False  # typing itself is not imported at start
if TYPE_CHECKING:
    from _socket import socket
    from typing import Mapping, Sequence

#: a snapshot's CRIU image files, in its directory, and what they are (snapshots/image.py)
IMAGES = "images"
MANIFEST = "manifest.json"
#: where scripts/install_criu.sh puts its wrapper, and the variable that names another criu to use first
INSTALLED_CRIU = "/opt/thawllm-criu/bin/criu"
CRIU_ENV = "THAWLLM_CRIU"
#: options of every dump and restore: the handoff socket is ours; deleted-but-open files are linked back
CRIU_OPTIONS = ("--link-remap",)
#: a gpu snapshot's process keeps a unix socket to the driver's side; CRIU must let it dangle
#: (docs/architecture.md)
GPU_OPTIONS = ("--ext-unix-sk",)
#: the restored process starts before its memory is back: a `criu lazy-pages` daemon, started first, copies
#: the pages in behind it and serves its faults first (userfaultfd); LAZY_PAGES, process snapshots
LAZY_OPTIONS = ("--lazy-pages",)
#: how long the lazy-pages daemon may take to be ready for the restore
LAZY_READY_S = 10.0
#: the kinds of CRIU snapshot
CRIU_KINDS = ("gpu", "process")

PR_SET_CHILD_SUBREAPER = 36
SIGKILL = 9  # the signal module imports enum
#: how long a restore may take before it is killed and failed
TIMEOUT_S = 300.0


def kind_options(kind: str, lazy_pages: bool = False) -> tuple[str, ...]:
    """What a KIND of snapshot adds to CRIU_OPTIONS at restore (LAZY_PAGES: process snapshots only)."""
    if kind == "gpu":
        return GPU_OPTIONS
    return LAZY_OPTIONS if lazy_pages else ()


def claim_name(snapshot_id: str) -> str:
    return f"\0thawllm-restorer-{snapshot_id}"


def claim(snapshot_id: str) -> "socket | None":
    """Hold SNAPSHOT_ID's restorer name. A process restored from the snapshot waits for its handoff only while
    some process holds it (snapshots/handoff.py: `receive`). Returns the socket (close it to let go), or None
    if another process holds the name."""
    return hold_name(claim_name(snapshot_id))


def claimed(snapshot_id: str) -> bool:
    """Whether some process holds SNAPSHOT_ID's restorer name."""
    return name_held(claim_name(snapshot_id))


def hold_name(name: str) -> "socket | None":
    """Bind the abstract unix socket NAME, which the kernel frees when this process ends, however it ends.
    Returns the socket, or None if another process in this network namespace holds the name."""
    import _socket  # not `socket`: its enums are not on the way to CRIU

    sock = _socket.socket(_socket.AF_UNIX, _socket.SOCK_STREAM)  # not inherited: criu must not keep it alive
    try:
        sock.bind(name)
    except OSError:
        sock.close()
        return None
    return sock


def name_held(name: str) -> bool:
    """Whether another process holds the abstract unix socket NAME."""
    probe = hold_name(name)
    if probe is None:
        return True
    probe.close()
    return False


def image_file_problem(images: str | os.PathLike, files: dict[str, int]) -> str | None:
    """Why the image files in IMAGES are not the ones baked (FILES: name -> size), None when each is there
    with its size. Cheap (no reading), and it must come first: CRIU can hang on a truncated page image."""
    for name, size in files.items():
        try:
            actual = os.stat(os.path.join(images, name)).st_size
        except FileNotFoundError:
            return f"image file {name} is missing"
        if actual != size:
            return f"image file {name} is {actual} bytes, baked {size}"
    return None


class RestoreRun:
    """`criu restore -d` of the image files in IMAGES with OPTIONS (CRIU_OPTIONS and what the snapshot's
    kind adds), from its start to `wait()`. The restored root becomes this process's child: this process
    is made a subreaper before CRIU starts. With LAZY_OPTIONS, `lazy_pages` is the pid of the daemon that
    fills the restored memory in after `wait()`: whoever supervises the restored process watches it. A
    daemon that cannot start (a kernel without userfaultfd) leaves a plain restore, and its reason in
    `lazy_refused`. KERNEL_FEATURES: the snapshot's record of the kernel's features, offered to criu while it
    restores (snapshots/kernel_features.py). The restore holds the snapshot's restorer name (`claim`, by
    SNAPSHOT_ID) from before CRIU starts until `release_claim`: killed before it hands over, this process lets
    go of it, and the restored process, finding no restorer, exits."""

    def __init__(self, criu_path: str, images: str | os.PathLike, snapshot_id: str, options: Sequence[str],
                 kernel_features: Mapping | None = None) -> None:
        set_subreaper()
        self._claim = claim(snapshot_id)  # None: another restore of it is under way
        self.criu_path, self.images, self.options = criu_path, os.fspath(images), tuple(options)
        self.workdir = _private_dir()
        self._pidfile = os.path.join(self.workdir, "pid")
        self._log = os.path.join(self.workdir, "restore.log")
        self._stderr = os.path.join(self.workdir, "stderr")
        self._outcome: tuple[int, float] | BaseException | None = None
        self.lazy_pages: int | None = None
        self.lazy_refused: str | None = None
        self.started = time.time()
        #: whether criu was handed the snapshot's record of the kernel's features (else it probed them)
        self.features_offered = False
        try:
            if kernel_features:
                from snapshots import kernel_features as features

                self.features_offered = features.offer(kernel_features)
            restore = [o for o in self.options if o not in LAZY_OPTIONS]
            if LAZY_OPTIONS[0] in self.options:
                self.lazy_pages = self._start_lazy_pages()
            if self.lazy_pages is not None:
                restore += [*LAZY_OPTIONS, "-W", self.workdir]
            self._pid = self._spawn("restore", ["-D", self.images, "-d", "--pidfile", self._pidfile, *restore,
                                                "-o", self._log, "-v4"])
        except BaseException:
            self.stop_lazy_pages()
            self._withdraw()
            _remove(self.workdir)
            self.release_claim()
            raise

    def _start_lazy_pages(self) -> int | None:
        """The lazy-pages daemon, ready for the restore; None (and `lazy_refused`) if it cannot start."""
        try:
            return self._spawn("lazy-pages", ["-D", self.images, "-W", self.workdir, "-o",
                                              os.path.join(self.workdir, "lazy-pages.log"), "-v2"], ready=True)
        except Exception as exc:  # noqa: BLE001 - CriuError, OSError: the restore goes on without it
            self.lazy_refused = str(exc).splitlines()[0]
            return None

    def _spawn(self, command: str, args: list[str], ready: bool = False) -> int:
        """criu COMMAND ARGS, its stderr kept; READY: wait until it says it is ready (--status-fd)."""
        null = os.open(os.devnull, os.O_RDWR)
        err = os.open(self._stderr, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        actions = [(os.POSIX_SPAWN_DUP2, null, 0), (os.POSIX_SPAWN_DUP2, null, 1), (os.POSIX_SPAWN_DUP2, err, 2)]
        status_read = status_write = None
        try:
            if ready:
                status_read, status_write = os.pipe()
                actions.append((os.POSIX_SPAWN_DUP2, status_write, 3))
                args = [*args, "--status-fd", "3"]
            pid = os.posix_spawn(self.criu_path, [self.criu_path, command, *args], os.environ, file_actions=actions)
        finally:
            for fd in (null, err, status_write):
                if fd is not None:
                    os.close(fd)
        if status_read is not None:
            try:
                if not _readable(status_read, LAZY_READY_S) or os.read(status_read, 1) != b"\0":
                    _kill(pid)
                    from snapshots.criu import failure

                    raise failure(command, 1, self._read_stderr(), os.path.join(self.workdir, "lazy-pages.log"))
            finally:
                os.close(status_read)
        return pid

    def matches(self, criu_path: str, images: str | os.PathLike, options: Sequence[str]) -> bool:
        """Whether this is the restore of IMAGES by CRIU_PATH with OPTIONS."""
        return (os.path.realpath(self.criu_path), os.path.realpath(self.images), self.options) == (
            os.path.realpath(criu_path), os.path.realpath(images), tuple(options))

    def wait(self, timeout: float = TIMEOUT_S) -> tuple[int, float]:
        """(the restored root's pid, CRIU's seconds: until it wrote the pidfile, as its restore ended); raises
        CriuError (CRIU undoes a restore that fails)."""
        if self._outcome is None:
            try:
                self._outcome = self._finish(timeout)
            except Exception as exc:  # noqa: BLE001 - kept: a second wait raises it again
                self._outcome = exc
            except BaseException:  # faas-build stopped (runtime/interrupts.py) while criu restores
                self._undo_unfinished(timeout)
                self.release_claim()
                from snapshots.criu import CriuError

                self._outcome = CriuError("the restore was interrupted; what CRIU restored was killed")
                raise
            finally:
                self._withdraw()
                _remove(self.workdir)
        if isinstance(self._outcome, BaseException):
            self.release_claim()  # nothing restored is left
            raise self._outcome
        return self._outcome

    def release_claim(self) -> None:
        """Let go of the snapshot's restorer name: the restored process has its handoff, or is gone. Until then
        no other restore of the snapshot can claim it."""
        if self._claim is not None:
            self._claim.close()
            self._claim = None

    def _withdraw(self) -> None:
        """criu has read the record of kernel features it was offered by now: no later criu run finds it (again
        after a second wait, a no-op: the link is gone)."""
        if self.features_offered:
            from snapshots import kernel_features

            kernel_features.withdraw()

    def _finish(self, timeout: float) -> tuple[int, float]:
        status = self._wait_exit(timeout)
        if status is None:
            from snapshots.criu import timed_out

            raise timed_out("restore", timeout, self._log)
        if os.waitstatus_to_exitcode(status) != 0:
            raise self._failure(os.waitstatus_to_exitcode(status))
        return self._restored_pid(), os.stat(self._pidfile).st_mtime - self.started

    def _restored_pid(self) -> int:
        """The restored root's pid, from the file CRIU writes once the restore is done."""
        with open(self._pidfile) as f:
            return int(f.read())

    def _undo_unfinished(self, timeout: float) -> None:
        """Interrupted before criu's outcome was known: let criu finish (it undoes a restore that fails; killed
        midway, it could leave a tree half restored), then kill what it restored. Left running, that process
        would wait for a handoff, holding the snapshot's handoff name."""
        try:
            pid, _ = self._finish(timeout)
        except (ChildProcessError, ProcessLookupError):  # criu reaped just before the interrupt: see its pid file
            try:
                pid = self._restored_pid()
            except (OSError, ValueError):
                return
        except Exception:  # noqa: BLE001 - criu failed and undid the restore: nothing is left
            return
        kill_tree(pid)
        self.stop_lazy_pages()

    def undo(self) -> None:
        """Wait for CRIU, then kill what it restored: nothing of this restore is left running."""
        try:
            pid, _ = self.wait()
        except Exception:  # noqa: BLE001 - CRIU failed and undid it: nothing is left
            return
        kill_tree(pid)
        self.stop_lazy_pages()
        self.release_claim()

    def stop_lazy_pages(self) -> None:
        """Kill and reap the lazy-pages daemon, if one is running: what it was filling in is gone."""
        if self.lazy_pages is not None:
            _kill(self.lazy_pages)
            self.lazy_pages = None

    def _wait_exit(self, timeout: float) -> int | None:
        """CRIU's wait status, or None after killing it once TIMEOUT passed."""
        fd = os.pidfd_open(self._pid)
        try:
            if not _readable(fd, timeout):
                os.kill(self._pid, SIGKILL)
                os.waitpid(self._pid, 0)
                return None
        finally:
            os.close(fd)
        return os.waitpid(self._pid, 0)[1]

    def _failure(self, code: int) -> Exception:
        """snapshots/criu.py's CriuError, with CRIU's first error (imported here: it imports this module)."""
        from snapshots.criu import failure

        self.stop_lazy_pages()
        return failure("restore", code, self._read_stderr(), self._log)

    def _read_stderr(self) -> str:
        try:
            with open(self._stderr, errors="replace") as f:
                return f.read()
        except OSError:
            return ""


def _kill(pid: int) -> None:
    try:
        os.kill(pid, SIGKILL)
        os.waitpid(pid, 0)
    except (ProcessLookupError, ChildProcessError):
        pass


def _readable(fd: int, timeout: float) -> bool:
    import select

    return bool(select.select([fd], [], [], timeout)[0])


def kill_tree(pid: int) -> None:
    """SIGKILL a restored root; as the init of its pid namespace, the kernel kills the rest with it."""
    _kill(pid)


def set_subreaper() -> None:
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_CHILD_SUBREAPER)")


def _private_dir() -> str:
    base = os.environ.get("TMPDIR") or "/tmp"
    while True:
        path = os.path.join(base, f"thawllm-restore-{os.getpid()}-{time.monotonic_ns()}")
        try:
            os.mkdir(path, 0o700)
            return path
        except FileExistsError:
            continue


def _remove(directory: str) -> None:
    try:
        for name in os.listdir(directory):
            os.unlink(os.path.join(directory, name))
        os.rmdir(directory)
    except FileNotFoundError:
        pass
