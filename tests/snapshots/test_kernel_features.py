"""criu's record of the kernel's features: taken by the bake, handed to criu by a restore on the machine it
describes, refused anywhere else, and never left behind."""

from __future__ import annotations

import json
import os
import subprocess
import zlib
from pathlib import Path

import pytest

from snapshots import kernel_features
from snapshots.image import MANIFEST
from tests.snapshots.test_process_snapshot import boot, health


@pytest.fixture
def paths(tmp_path, monkeypatch) -> tuple[Path, Path]:
    """RUN_RECORD and SHM_RECORD in a folder of the test's own."""
    run, shm = tmp_path / "run", tmp_path / "shm"
    run.mkdir(), shm.mkdir()
    monkeypatch.setattr(kernel_features, "RUN_RECORD", str(run / "criu.kdat"))
    monkeypatch.setattr(kernel_features, "SHM_RECORD", str(shm / "thawllm-criu.kdat"))
    return run / "criu.kdat", shm / "thawllm-criu.kdat"


def features(record: bytes = b"kdat of this machine", **machine: str) -> dict:
    return {"machine": kernel_features.machine() | machine, "record": record.hex(), "crc32": zlib.crc32(record)}


def test_a_record_of_this_machine_is_linked_for_criu_and_withdrawn_after(paths):
    run, shm = paths
    assert kernel_features.offer(features())
    assert os.readlink(run) == str(shm) and shm.read_bytes() == b"kdat of this machine"
    assert kernel_features.offer(features(b"a newer one"))  # our own link is reused
    assert run.read_bytes() == b"a newer one"
    kernel_features.withdraw()
    assert not os.path.lexists(run)


@pytest.mark.parametrize("field", ["kernel", "cpu"])
def test_a_record_of_another_machine_is_not_offered(paths, field):
    run, _ = paths
    assert not kernel_features.offer(features(**{field: "another"}))
    assert not os.path.lexists(run)


def test_a_damaged_record_is_not_offered(paths):
    run, _ = paths
    damaged = features() | {"record": b"kdat of thiz machine".hex()}
    assert not kernel_features.offer(damaged)
    assert not kernel_features.offer(features() | {"record": "not hex"})
    assert not kernel_features.offer({})
    assert not os.path.lexists(run)


def test_criu_s_own_record_is_left_alone(paths):
    run, _ = paths
    run.write_bytes(b"criu's own, on a tmpfs /run")
    assert not kernel_features.offer(features())
    kernel_features.withdraw()
    assert run.read_bytes() == b"criu's own, on a tmpfs /run"
    run.unlink()
    run.symlink_to("/elsewhere")  # nor a link someone else made
    assert not kernel_features.offer(features())
    kernel_features.withdraw()
    assert os.readlink(run) == "/elsewhere"


@pytest.mark.criu
def test_the_bake_records_this_machine_and_criu_loads_the_record_instead_of_probing(process_snapshot, tmp_path):
    recorded = json.loads((process_snapshot / "process" / MANIFEST).read_text())["kernel_features"]
    assert recorded["machine"] == kernel_features.machine()
    record = bytes.fromhex(recorded["record"])
    assert len(record) > 100 and zlib.crc32(record) == recorded["crc32"]
    if os.path.lexists(kernel_features.RUN_RECORD) and not kernel_features._ours():
        pytest.skip("criu keeps its own record here (/run is a tmpfs): the baked one is not needed")
    from snapshots.criu import find_criu

    def criu_log(name: str) -> str:
        log = tmp_path / name
        subprocess.run([find_criu().path, "check", "-o", str(log), "-v4"], capture_output=True, timeout=60)
        return log.read_text()

    assert kernel_features.offer(recorded)
    try:
        assert f"Loaded kdat cache from {kernel_features.RUN_RECORD}" in criu_log("offered.log")
    finally:
        kernel_features.withdraw()
    assert not os.path.lexists(kernel_features.RUN_RECORD)
    assert "Loaded kdat cache" not in criu_log("withdrawn.log")


@pytest.mark.criu
@pytest.mark.parametrize("cache", ["1", "0"])
def test_a_restore_says_whether_criu_had_the_record(process_snapshot, tiny_model_dir, tmp_path, cache):
    if os.path.lexists(kernel_features.RUN_RECORD) and not kernel_features._ours():
        pytest.skip("criu keeps its own record here (/run is a tmpfs): the baked one is not offered")
    server = boot(tmp_path, tiny_model_dir, process_snapshot, CRIU_FEATURE_CACHE=cache)
    try:
        restore = next(s for s in health(server)["stages"] if s["stage"] == "restore")
        assert restore["detail"]["kernel_features"] == ("record" if cache == "1" else "probed")
        assert not os.path.lexists(kernel_features.RUN_RECORD)  # withdrawn once criu had restored
    finally:
        server.stop()


@pytest.mark.criu
def test_a_record_that_cannot_be_taken_says_why(tmp_path):
    features, why = kernel_features.probe(str(tmp_path / "no-criu"))
    assert features is None and "criu.kdat" in why  # criu never ran, so it wrote no record
