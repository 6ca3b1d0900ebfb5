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
