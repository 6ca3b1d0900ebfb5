"""The device start before the hand-over (snapshots/device_start.py), between a real child process standing in
for CRIU and a listener in this process standing in for the restored runtime: when the start goes, what
environment the runtime then has, and when the hand-over must wait for the device start to finish."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
import uuid

import pytest

from snapshots.device_start import Listener, Sender


@pytest.fixture
def environ():
    """This process's environment, put back after the test (a start replaces it)."""
    saved = dict(os.environ)
    yield
    os.environ.clear()
    os.environ.update(saved)


class Device:
    """What a restored engine's device start does, held until `release()`."""

    def __init__(self) -> None:
        self.began = threading.Event()
        self._release = threading.Event()
        self.finished = threading.Event()
        self.seen: str | None = None

    def start(self) -> None:
        self.seen = os.environ.get("THAWLLM_TEST_DEVICE")
        self.began.set()
        self._release.wait(10)
        self.finished.set()

    def release(self) -> None:
        self._release.set()


def criu_stand_in(seconds: float) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", f"import time; time.sleep({seconds})"])


def test_the_start_goes_as_soon_as_the_restored_socket_listens(environ):
    snapshot_id, device = uuid.uuid4().hex, Device()
    boot = dict(os.environ) | {"THAWLLM_TEST_DEVICE": "1"}
    criu = criu_stand_in(1.0)
    sender = Sender(criu.pid, snapshot_id, boot)
    time.sleep(0.1)
    assert sender.sent_at is None  # nothing listens yet: CRIU has not restored the socket
    listener = Listener(snapshot_id, device.start)  # restored, while CRIU still runs
    assert device.began.wait(0.5) and device.seen == "1" and criu.poll() is None
    sender.join(5)
    assert sender.sent_at is not None and listener.started_at is not None
    # the hand-over brings the same environment: it does not wait for the device, which is still starting
    settled = time.monotonic()
    listener.settle(boot)
    assert time.monotonic() - settled < 1 and not device.finished.is_set()
    assert dict(os.environ) == boot
    device.release()
    assert device.finished.wait(5)


def test_a_hand_over_with_another_environment_waits_for_the_device_start(environ):
    snapshot_id, device = uuid.uuid4().hex, Device()
    listener = Listener(snapshot_id, device.start)
    criu = criu_stand_in(0)
    Sender(criu.pid, snapshot_id, dict(os.environ) | {"THAWLLM_TEST_DEVICE": "1"})
    criu.wait()
    assert device.began.wait(5)
    threading.Timer(0.3, device.release).start()
    listener.settle(dict(os.environ) | {"THAWLLM_TEST_DEVICE": "2"})  # before the hand-over changes it
    assert device.finished.is_set()


def test_no_start_after_the_hand_over(environ):
    snapshot_id, device = uuid.uuid4().hex, Device()
    listener = Listener(snapshot_id, device.start)
    listener.settle(dict(os.environ))  # the hand-over came first: nobody listens any more
    criu = criu_stand_in(0.2)
    sender = Sender(criu.pid, snapshot_id, dict(os.environ) | {"THAWLLM_TEST_DEVICE": "1"})
    sender.join(5)  # gives up once CRIU has exited
    assert criu.poll() is not None
    assert sender.sent_at is None and listener.started_at is None
    assert not device.began.wait(0.2) and "THAWLLM_TEST_DEVICE" not in os.environ
