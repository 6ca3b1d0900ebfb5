"""The handoff: how a process restored from a snapshot learns about the instance it now runs in.

At bake time the frozen process listens on an abstract unix socket (no file to clean up; CRIU restores it
listening) and waits in accept(), for as long as some process holds the snapshot's restorer name
(`accept_while_claimed`). After `criu restore` the bootstrap connects and sends one message: its environment
(PORT, API_KEY... are read after restore, never baked), working directory, spawn time, the reasons faster
paths were skipped, and (SCM_RIGHTS) its stdout and stderr, which the restored process puts in place of the
/dev/null it was frozen with, and for a gpu restore whose weights stream during the restore, the socket the
CUDA restore helper hands them over on (snapshots/weights_during_restore.py). The restored process answers
"ok" once it has taken over.
"""

from __future__ import annotations

import array
import json
import os
import socket
import time
from dataclasses import asdict, dataclass, field

from snapshots.restore_run import claimed, name_held

ACK = b"ok"
_MAX_MESSAGE = 1 << 20
#: how often a process waiting for its handoff checks that a restorer is there, and its status when none is
CLAIM_CHECK_S = 1.0
ORPHANED_EXIT = 3


class HandoffError(RuntimeError):
    pass


@dataclass
class Handoff:
    environ: dict[str, str]
    cwd: str
    spawn_time: float  # the bootstrap's spawn: the restored process's timeline is measured from it
    restore_started: float
    restore_path: str  # "process" or "gpu"
    argv: list[str] = field(default_factory=list)  # the bootstrap's flags, parsed again after restore
    skipped: dict[str, str] = field(default_factory=dict)
    verify: bool = False  # faas-build's check that the image restores: take over, answer, exit 0
    restore_detail: dict[str, float | bool | str] = field(default_factory=dict)  # CRIU's and CUDA's parts, how criu ran
    weights_channel: bool = False  # a third descriptor: the helper's weights (see above)
    verify_span: list[float] = field(default_factory=list)  # [start, end, bytes] of the image files' check


def socket_name(snapshot_id: str) -> str:
    return f"\0thawllm-handoff-{snapshot_id}"


def listen(snapshot_id: str) -> socket.socket:
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(socket_name(snapshot_id))
    listener.listen(1)
    return listener


def name_taken(snapshot_id: str) -> bool:
    """Whether another process holds SNAPSHOT_ID's handoff name in this network namespace: one restored from
    the same snapshot still waiting for its handoff. CRIU cannot restore the listener of a second one then."""
    return name_held(socket_name(snapshot_id))


def receive(listener: socket.socket, snapshot_id: str
            ) -> tuple[Handoff, socket.socket, socket.socket | None]:
    """Restored side: wait for the bootstrap, take over its stdout/stderr, environment and directory.
    Returns the message, the connection (to acknowledge on) and the weights channel, if one came."""
    conn = accept_while_claimed(listener, snapshot_id)  # the frozen process waits here, and resumes here
    listener.close()
    fds = array.array("i")
    message, ancillary, _, _ = conn.recvmsg(_MAX_MESSAGE, socket.CMSG_SPACE(3 * fds.itemsize))
    for level, kind, data in ancillary:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            fds.frombytes(data[: len(data) - len(data) % fds.itemsize])
    handoff = Handoff(**json.loads(message))
    expected = 3 if handoff.weights_channel else 2
    if len(fds) != expected:
        raise HandoffError(f"expected {expected} descriptors (stdout, stderr, weights channel), got {len(fds)}")
    for target, fd in zip((1, 2), fds):
        os.dup2(fd, target)
        os.close(fd)
    channel = socket.socket(fileno=fds[2]) if handoff.weights_channel else None
    os.environ.clear()
    os.environ.update(handoff.environ)
    os.chdir(handoff.cwd)
    return handoff, conn, channel


def accept_while_claimed(listener: socket.socket, snapshot_id: str) -> socket.socket:
    """The bootstrap's connection. A process restored from the snapshot whose restorer was killed before the
    hand-over would wait forever, holding the handoff name, so that no later restore of the snapshot could
    run: every CLAIM_CHECK_S it checks that a process holds the snapshot's restorer name (the bake while it
    waits to be checkpointed, the restore until it hands over: snapshots/restore_run.py, `claim`), and exits
    when none does. The wait's timeout is safe across a restore: CRIU keeps the monotonic clock going on from
    where it stood (it restores the process into a time namespace)."""
    listener.settimeout(CLAIM_CHECK_S)
    while True:
        try:
            conn, _ = listener.accept()
            return conn
        except TimeoutError:
            if not claimed(snapshot_id):
                os._exit(ORPHANED_EXIT)


def acknowledge(conn: socket.socket) -> None:
    conn.sendall(ACK)
    conn.close()


def send(snapshot_id: str, handoff: Handoff, timeout: float, channel: socket.socket | None = None) -> None:
    """Bootstrap side: connect to the restored process, hand it over (with CHANNEL, the weights' socket, when
    `handoff.weights_channel`), wait for its "ok"."""
    deadline = time.monotonic() + timeout
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        while True:
            try:
                sock.connect(socket_name(snapshot_id))
                break
            except (ConnectionRefusedError, FileNotFoundError):
                if time.monotonic() > deadline:
                    raise HandoffError("the restored process is not listening for the handoff") from None
                time.sleep(0.005)
        sock.settimeout(max(0.1, deadline - time.monotonic()))
        fds = [1, 2, channel.fileno()] if handoff.weights_channel else [1, 2]
        sock.sendmsg([json.dumps(asdict(handoff)).encode()],
                     [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds))])
        try:
            answer = sock.recv(len(ACK))
        except socket.timeout:
            raise HandoffError(f"the restored process did not take over within {timeout:.0f} s") from None
    if answer != ACK:
        raise HandoffError("the restored process closed the handoff without taking over")
