"""The CRIU machinery the process and gpu snapshots share: freeze the runtime in a new pid namespace, dump
it, restore it, hand it over.

Pid namespace: the frozen process is the init (pid 1) of its own pid namespace, and CRIU restores that
namespace as a new one. Its pids are then the same on every restore and can never clash with the
container's (a plain restore needs the baked pids, threads included, to be free). Killing that init kills
the whole restored tree, so a restore that fails midway leaves nothing behind.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Callable

from runtime.config import Settings
from runtime.logs import get_logger
from snapshots import handoff
from snapshots.criu import Criu, CriuError
from snapshots.restore_run import CRIU_OPTIONS, IMAGES, RestoreRun, claim, kill_tree

if TYPE_CHECKING:
    import _socket

log = get_logger("snapshots.checkpoint")

REPO_ROOT = Path(__file__).resolve().parents[1]


class SnapshotError(RuntimeError):
    """A bake or a restore failed; the message is one line, or ends with the tail of a log."""


@dataclass
class Frozen:
    """A runtime process built and parked, ready to be checkpointed."""

    wrapper: subprocess.Popen  # `unshare`, the parent of the namespace's init (or the process itself)
    pid: int  # the frozen process's pid as this process sees it
    snapshot_id: str
    log_path: Path
    #: the snapshot's restorer name, held while the process waits to be checkpointed (restore_run.py: `claim`)
    claim: _socket.socket | None = None

    def release(self) -> None:
        """Let go of the restorer name: the process has been dumped, or killed."""
        if self.claim is not None:
            self.claim.close()
            self.claim = None


def freeze_runtime(kind: str, model_dir: Path | None, environ: dict[str, str], workdir: Path,
                   pid_namespace: bool = True, timeout: float = 1800.0) -> Frozen:
    """Start `snapshots.frozen` (as the init of a new pid namespace); return once it is parked. MODEL_DIR
    None: the several models MODEL (in ENVIRON) names."""
    import uuid  # the bake's alone: a restore does not pay for it

    snapshot_id = uuid.uuid4().hex[:16]
    log_path = workdir / f"bake-{kind}.log"
    read_end, write_end = os.pipe()
    env = dict(environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), env.get("PYTHONPATH")]))
    command = [sys.executable, "-m", "snapshots.frozen", "--kind", kind, "--snapshot-id", snapshot_id,
               "--ready-fd", str(write_end)]
    if model_dir is not None:
        command += ["--model-dir", str(model_dir)]
    if pid_namespace:
        command = ["unshare", "--pid", "--fork", *command]
    held = claim(snapshot_id)  # before it starts: it waits for its handoff only while someone holds the name
    with open(log_path, "wb") as log_file:
        # cwd "/": CRIU restores the working directory, and / exists wherever the image goes
        wrapper = subprocess.Popen(command, cwd="/", env=env, stdin=subprocess.DEVNULL, stdout=log_file,
                                   stderr=subprocess.STDOUT, pass_fds=(write_end,))
    os.close(write_end)
    try:
        with os.fdopen(read_end, "rb") as ready:
            ready_line = _read_line(ready, timeout)
        if ready_line != b"ready\n":
            wrapper.kill()
            wrapper.wait()
            raise SnapshotError(f"the {kind} runtime did not get ready:\n{_tail(log_path)}")
        if not pid_namespace:
            return Frozen(wrapper, wrapper.pid, snapshot_id, log_path, held)
        children = Path(f"/proc/{wrapper.pid}/task/{wrapper.pid}/children").read_text().split()
        return Frozen(wrapper, int(children[0]), snapshot_id, log_path, held)
    except BaseException:
        wrapper.kill()
        if held is not None:
            held.close()
        raise


def dump(criu: Criu, frozen: Frozen, directory: Path, extra: list[str] = ()) -> float:
    """criu dump into DIRECTORY/images (the process is killed by the dump); returns seconds taken."""
    images = directory / IMAGES
    images.mkdir(parents=True)
    started = time.time()
    try:
        criu.run(["dump", "-t", str(frozen.pid), "-D", str(images), *CRIU_OPTIONS, *extra],
                 directory / "dump.log")
    except CriuError as exc:
        raise SnapshotError(str(exc)) from None
    finally:
        frozen.release()  # dumped, it is gone; left running by a failed dump, it now ends by itself
        if frozen.wrapper.pid != frozen.pid:
            frozen.wrapper.kill()
        frozen.wrapper.wait()
    return time.time() - started


def start_restore(criu: Criu, directory: Path, snapshot_id: str, extra: list[str] = (),
                  kernel_features: dict | None = None) -> RestoreRun:
    """criu restore of the snapshot in DIRECTORY (SNAPSHOT_ID: its manifest's), detached, in the background: the
    restored init becomes our child (we are its subreaper). CRIU undoes a restore that fails. KERNEL_FEATURES:
    the snapshot's record of the kernel's features, offered to criu (snapshots/kernel_features.py)."""
    return RestoreRun(criu.path, directory / IMAGES, snapshot_id, [*CRIU_OPTIONS, *extra], kernel_features)


def finish_restore(run: RestoreRun) -> tuple[int, float]:
    """The restored init's pid and CRIU's seconds; raises SnapshotError."""
    try:
        return run.wait()
    except (CriuError, OSError) as exc:
        raise SnapshotError(str(exc)) from None


def hand_over(pid: int, snapshot_id: str, message: handoff.Handoff, timeout: float,
              before: Callable[[int], None] | None = None, channel: socket.socket | None = None,
              check: Callable[[], None] | None = None) -> None:
    """Give the restored process its instance (after `before(pid)`, e.g. the CUDA restore, and `check()`,
    the image's verdict; with CHANNEL, the weights' socket). On any failure the restored tree is killed
    before the error is raised: a restored process that did not get its instance never serves."""
    try:
        if before is not None:
            before(pid)
        if check is not None:
            check()
        handoff.send(snapshot_id, message, timeout, channel)
    except BaseException:
        kill_tree(pid)
        raise


def settings_environ(settings: Settings, base: dict[str, str] | None = None) -> dict[str, str]:
    """The environment that reproduces SETTINGS in a child process (values at their default are left out,
    so a child reading them sees the same)."""
    env = dict(os.environ if base is None else base)
    defaults = Settings()
    for f in Settings.fields():
        value = getattr(settings, f.name)
        if value != getattr(defaults, f.name) and value is not None:
            env[f.metadata["env"]] = str(value).lower() if isinstance(value, bool) else str(value)
    return env


def replace_dir(tmp: Path, final: Path) -> None:
    """Rename a finished snapshot into place (an older one is removed first)."""
    if final.exists():
        shutil.rmtree(final)
    os.rename(tmp, final)


def _read_line(stream, timeout: float) -> bytes:
    import select

    if not select.select([stream], [], [], timeout)[0]:
        return b""
    return stream.readline()


def _tail(path: Path, lines: int = 25) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").strip().splitlines()[-lines:])
    except OSError:
        return ""
