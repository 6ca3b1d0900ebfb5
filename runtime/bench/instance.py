"""One server instance, started the way a container starts: a new `faas-bootstrap` process on a free
loopback port, its settings in the environment, timed from the moment before the spawn."""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from runtime.bench import BenchError
from runtime.bench.records import SITE_FIRST, VARIANTS

#: the checkout the bench runs from; the processes it starts import the same one
SOURCE_ROOT = Path(__file__).resolve().parents[2]


class InstanceFailed(BenchError):
    """The server exited, reported a failed start, or was not ready in time."""


class ModeUnavailable(BenchError):
    """The server came up on another restore path than the mode asked for (the mode's snapshot is absent,
    stale or unsupported here); the message is the server's reason."""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def entry_command(site_first: bool = False) -> list[str]:
    """The entry point started as the image's `faas-bootstrap` starts it (Dockerfile): without `site`, which it
    runs once it has started the restore (runtime/entry.py). SITE_FIRST: after `site`, as pip's console script."""
    return [sys.executable, *(() if site_first else ("-S",)), "-m", "runtime.entry"]


def child_environment(settings: dict[str, str], spawned_at: float) -> dict[str, str]:
    """This environment plus `settings`, importing this checkout, with the timeline's origin set to the
    bench's spawn moment (runtime/timeline.py), so the child's stages and the bench's clock agree."""
    env = {k: v for k, v in os.environ.items() if k != "AWS_LAMBDA_RUNTIME_API"}  # serve HTTP, not Lambda
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(SOURCE_ROOT), env.get("PYTHONPATH")]))
    env.update(settings)
    env["THAWLLM_SPAWN_TIME"] = repr(spawned_at)
    return env


@dataclass
class Instance:
    mode: str
    process: subprocess.Popen
    port: int
    spawned_at: float
    log_path: Path
    ready_at: float | None = None
    health: dict = field(default_factory=dict)

    @classmethod
    def spawn(cls, mode: str, settings: dict[str, str], log_path: Path, own_pid_namespace: bool = False) -> "Instance":
        """Start `faas-bootstrap`. OWN_PID_NAMESPACE: as the init of a pid namespace with its own /proc, as a
        container's process is (needs root): a restored snapshot keeps its baked pids, so two instances
        restored from one snapshot on one host clash without it."""
        port = free_port()
        command = entry_command(site_first=mode in SITE_FIRST)
        if own_pid_namespace:
            command = ["unshare", "--pid", "--fork", "--mount-proc", "--kill-child", *command]
        log_path.parent.mkdir(parents=True, exist_ok=True)
        path, changed = VARIANTS.get(mode, (mode, {}))
        spawned_at = time.time()
        with open(log_path, "wb") as log:
            # its own process group: stop() reaches whatever the bootstrap starts (a CRIU restore, workers)
            process = subprocess.Popen(command, cwd=SOURCE_ROOT,
                                       env=child_environment(settings | changed | {
                                           "PORT": str(port), "HOST": "127.0.0.1", "RESTORE": path}, spawned_at),
                                       stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        return cls(mode, process, port, spawned_at, log_path)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    async def wait_ready(self, client: httpx.AsyncClient, timeout: float, poll_s: float = 0.01) -> dict:
        """Poll /health until 200; returns its body. Raises InstanceFailed on exit, failure or timeout."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise InstanceFailed(f"the {self.mode} server failed to start: it exited with "
                                     f"{self.process.returncode}: {self.log_tail()}")
            try:
                response = await client.get(f"{self.url}/health", timeout=5)
            except httpx.TransportError:  # not listening yet
                await asyncio.sleep(poll_s)
                continue
            body = response.json()
            if response.status_code == 200:
                self.ready_at = time.time()
                self.health = body
                return body
            if body.get("status") == "failed":
                raise InstanceFailed(f"the {self.mode} server failed to start: {body.get('error')}")
            await asyncio.sleep(poll_s)
        raise InstanceFailed(f"the {self.mode} server was not ready after {timeout:.0f} s: {self.log_tail()}")

    def check_restore_path(self) -> None:
        """Raise ModeUnavailable unless the ready server took the path this instance was started for."""
        path = VARIANTS.get(self.mode, (self.mode,))[0]
        taken = self.health.get("restore_path")
        if taken != path:
            raise ModeUnavailable(self.health.get("skipped", {}).get(path) or f"the server took the {taken} path")

    async def fetch_health(self, client: httpx.AsyncClient) -> dict:
        response = await client.get(f"{self.url}/health", timeout=10)
        self.health = response.json()
        return self.health

    def log_tail(self, lines: int = 3) -> str:
        try:
            text = self.log_path.read_text(errors="replace").strip().splitlines()
        except OSError:
            return "(no log)"
        return " | ".join(text[-lines:]) or "(empty log)"

    async def stop(self, grace_s: float = 30.0) -> int:
        """SIGTERM to the instance's process group (the server drains), then SIGKILL after `grace_s`."""
        self._signal_group(signal.SIGTERM)
        try:
            await asyncio.to_thread(self.process.wait, grace_s)
        except subprocess.TimeoutExpired:
            self._signal_group(signal.SIGKILL)
        return await asyncio.to_thread(self.process.wait)

    def _signal_group(self, sig: int) -> None:
        try:
            os.killpg(self.process.pid, sig)  # the group this instance's spawn created, by its id
        except ProcessLookupError:  # every process of the group has exited
            pass
