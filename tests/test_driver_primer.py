"""The driver primer a process restore on a GPU starts beside CRIU (snapshots/driver_primer.py)."""

import subprocess
import sys
from pathlib import Path

import pytest

from snapshots.driver_primer import device_index

REPO = Path(__file__).resolve().parents[1]


def test_the_gpu_index_comes_from_the_engine_device():
    assert [device_index(d) for d in ("cuda", "cuda:0", "cuda:3")] == [0, 0, 3]


def test_a_primer_that_cannot_make_a_context_says_why_and_ends_at_once():
    done = subprocess.run([sys.executable, "-m", "snapshots.driver_primer", "0"], cwd=REPO, capture_output=True,
                          text=True, timeout=60, env={"PATH": "/usr/bin:/bin", "CUDA_VISIBLE_DEVICES": ""})
    if done.returncode == 0:
        pytest.skip("a GPU driver made a context here")
    assert done.returncode == 1 and done.stderr.startswith("driver primer: ")

