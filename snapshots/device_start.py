"""The device start before the hand-over: a restored process snapshot begins its device phase the moment CRIU
is done, not once the bootstrap hands it over.

The hand-over (snapshots/handoff.py) waits for the image's digests and, when CRIU was started by the entry
point, for the bootstrap's own imports and checks; the restored runtime's first job after it, making its
CUDA context, took 0.13-0.19 s on the H200 machine and needs none of what the hand-over brings. So the frozen
process also listens on a second socket, on a thread of its own, and `Sender` (started with every boot's
`criu restore`, snapshots/restore_run.py) sends the boot's environment to it as soon as CRIU has restored
that socket (CUDA_VISIBLE_DEVICES and the rest are read when the context is made). The restored process
reads it the moment it resumes and starts its device (`Engine.init_device`), while CRIU exits and the
bootstrap finishes its checks; it serves nothing, and
gets stdout, stderr and the go-ahead, until the hand-over, which comes only after every check has passed. A
restore the bootstrap does not take is killed, whatever its device was doing.

One environment is applied once: the hand-over carries the same one, and `Listener.settle` makes sure the
thread is done changing it before the hand-over looks at it (the C library's environment is not safe to
change while another thread reads it, as the driver does when it starts). A sender that finds nobody
listening (a gpu snapshot, a snapshot baked before this existed) gives up at once: the device starts after
the hand-over, as it did before.

Imports: the sender side runs in the entry point before the bootstrap is imported, so only os, json and
time at import; socket and threading when a sender starts, after CRIU has been spawned.
"""

from __future__ import annotations

import json
import os
import time

TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Callable, Mapping

#: the longest environment a start message may carry
MAX_MESSAGE = 1 << 20


def socket_name(snapshot_id: str) -> str:
    return f"\0thawllm-device-start-{snapshot_id}"


#: how often the sender tries to connect while CRIU restores
RETRY_S = 0.002


class Sender:
    """Sends ENVIRON to the restored process of SNAPSHOT_ID from a thread: it connects as soon as CRIU (the
    process PID) has restored the listening socket, which is early in a restore, so the message waits in the
    socket for the process to resume; it gives up once CRIU has exited with nobody listening. Never raises:
    without it the device starts after the hand-over."""

    def __init__(self, pid: int, snapshot_id: str, environ: Mapping[str, str]) -> None:
        import threading

        self.sent_at: float | None = None
        self._message = json.dumps(dict(environ)).encode()
        self._name = socket_name(snapshot_id)
        self._pidfd = os.pidfd_open(pid)  # now, while PID is surely CRIU: nobody has reaped it yet
        self._thread = threading.Thread(target=self._run, name="device-start", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        import select
        import socket

        try:
            while True:
                exited = bool(select.select([self._pidfd], [], [], RETRY_S)[0])
                try:
                    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
                        sock.connect(self._name)
                        sock.sendall(self._message)
                    self.sent_at = time.time()
                    return
                except OSError:  # not restored yet; once CRIU is gone, nothing will listen
                    if exited:
                        return
        finally:
            os.close(self._pidfd)

    def join(self, timeout: float | None = None) -> None:
        self._thread.join(timeout)


class Listener:
    """The frozen process's side: a thread blocked in accept() when the snapshot is taken. After a restore,
    the start message's environment becomes the process's and ON_START runs on that thread."""

    def __init__(self, snapshot_id: str, on_start: Callable[[], None]) -> None:
        import socket
        import threading

        self.started_at: float | None = None
        self._on_start = on_start
        self._environ: dict[str, str] | None = None
        self._closed = False
        self._lock = threading.Lock()
        self._socket = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._socket.bind(socket_name(snapshot_id))
        self._socket.listen(1)
        self._thread = threading.Thread(target=self._run, name="device-start", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            conn, _ = self._socket.accept()  # the snapshot is taken here; CRIU restarts the call
            with conn:
                environ = json.loads(_read_all(conn))
        except (OSError, ValueError):
            return  # settled before any start came, or a start that is not one: the hand-over starts it
        with self._lock:  # settle() sees the environment either untouched or whole
            if self._closed:
                return
            self.started_at = time.time()
            self._environ = environ
            os.environ.clear()
            os.environ.update(environ)
        try:
            self._on_start()
        except Exception:  # noqa: BLE001 - the engine's start makes the device again and reports what fails
            pass

    def settle(self, environ: Mapping[str, str]) -> None:
        """Called with the hand-over's ENVIRON before it is applied: no start begins after this, and one under
        way that brought another environment (which the hand-over will replace) is waited for."""
        import socket

        with self._lock:
            self._closed = True
            started, same = self.started_at is not None, self._environ == dict(environ)
        try:
            self._socket.shutdown(socket.SHUT_RDWR)  # wakes the accept() if no start came
        except OSError:
            pass
        self._socket.close()
        if started and not same:
            self._thread.join()


def _read_all(conn) -> bytes:
    chunks, size = [], 0
    while True:
        chunk = conn.recv(1 << 16)
        if not chunk:
            return b"".join(chunks)
        size += len(chunk)
        if size > MAX_MESSAGE:
            raise ValueError("start message too long")
        chunks.append(chunk)
