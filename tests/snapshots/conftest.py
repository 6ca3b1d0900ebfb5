"""A process snapshot of the runtime serving the tiny model, baked once per test run with real CRIU."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from runtime.config import Settings
from tests.server.conftest import tiny_model_dir  # noqa: F401  (the served tiny model fixture)

#: what the function is configured with at bake and at boot (PORT and API_KEY differ: read after restore)
ENGINE_ENV = {"DEVICE": "cpu", "MAX_MODEL_LEN": "2048", "MAX_NUM_SEQS": "16"}
BAKE_ONLY = {"PORT": "1", "API_KEY": "key-from-bake-time"}


@pytest.fixture(scope="session")
def process_snapshot(tiny_model_dir, tmp_path_factory) -> Path:  # noqa: F811
    from snapshots.process import bake_process_snapshot

    snapshot_dir = tmp_path_factory.mktemp("snapshots")
    settings = Settings.from_env({"MODEL": str(tiny_model_dir), **ENGINE_ENV, **BAKE_ONLY})
    bake_process_snapshot(settings, tiny_model_dir, snapshot_dir)
    return snapshot_dir


@pytest.fixture
def snapshot_copy(process_snapshot, tmp_path) -> Path:
    """A copy a test may damage."""
    copy = tmp_path / "snapshots"
    shutil.copytree(process_snapshot, copy)
    return copy
