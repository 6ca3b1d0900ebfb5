"""The driver primer a bootstrap starts before restoring a snapshot onto a GPU (snapshots/driver_primer.py)."""

import subprocess

import pytest

from runtime.config import Settings
from snapshots.driver_primer import primer_command, wanted


def test_a_primer_that_cannot_make_a_context_says_why_and_ends_at_once(tmp_path):
    done = subprocess.run(primer_command(), cwd=tmp_path, capture_output=True, text=True,
                          timeout=60, env={"CUDA_VISIBLE_DEVICES": ""})
    if done.returncode == 0:
        pytest.skip("a GPU driver made a context here")
    assert done.returncode == 1 and done.stderr.startswith("driver primer: ")


@pytest.mark.parametrize("env, primed", [
    ({}, True), ({"DEVICE": "cuda", "RESTORE": "process"}, True),
    ({"DEVICE": "cpu"}, False), ({"PRIME_DRIVER": "0"}, False), ({"RESTORE": "gpu"}, False),
    ({"RESTORE": "cold"}, False), ({"SNAPSHOT_DIR": ""}, False)])
def test_a_primer_only_where_a_process_snapshot_may_be_restored_onto_a_gpu(env, primed, tmp_path, monkeypatch):
    monkeypatch.setenv("MODEL", str(tmp_path))
    monkeypatch.setenv("SNAPSHOT_DIR", str(tmp_path))
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    assert wanted(Settings.from_env()) is primed


def test_a_start_has_one_primer_and_it_is_reaped_when_it_ends(tmp_path, monkeypatch):
    import os
    import time

    from snapshots import driver_primer

    node = tmp_path / "nvidiactl"
    node.touch()
    monkeypatch.setattr(driver_primer, "DRIVER_NODE", str(node))
    monkeypatch.setattr(driver_primer, "_started", None)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")  # where a GPU is there, the primer ends at once all the same
    monkeypatch.setenv("MODEL", str(tmp_path))
    monkeypatch.setenv("SNAPSHOT_DIR", str(tmp_path))
    pid = driver_primer.start()
    assert pid is not None and driver_primer.start() == pid
    assert driver_primer.start_primer(Settings.from_env()) == pid
    deadline = time.monotonic() + driver_primer.HOLD_S + 30
    while os.path.exists(f"/proc/{pid}") and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not os.path.exists(f"/proc/{pid}"), "the primer is left a zombie"


def test_no_primer_without_a_gpu_driver(tmp_path, monkeypatch):
    from snapshots import driver_primer

    monkeypatch.setattr(driver_primer, "DRIVER_NODE", str(tmp_path / "nvidiactl"))
    monkeypatch.setattr(driver_primer, "_started", None)
    assert driver_primer.start() is None
