"""The fingerprint and the CRIU prerequisites: what decides, at every boot, whether a snapshot is used."""

from __future__ import annotations

import json
import shutil

import pytest

from runtime.config import Settings
from snapshots.criu import Criu, restore_blockers
from snapshots.fingerprint import current_fingerprint, mismatch, model_hash


def test_instance_settings_are_not_in_the_fingerprint_but_engine_settings_are(tiny_model):
    model = tiny_model("tiny-llama")
    baked = current_fingerprint(Settings.from_env({"MODEL": model, "DEVICE": "cpu", "PORT": "1"}), "4.1.1")
    same = current_fingerprint(Settings.from_env({"MODEL": model, "DEVICE": "cpu", "PORT": "8080",
                                                  "API_KEY": "k", "HANDLER": "x:y", "LOG_LEVEL": "debug"}), "4.1.1")
    assert mismatch(baked, same) is None
    longer = current_fingerprint(Settings.from_env({"MODEL": model, "DEVICE": "cpu", "MAX_MODEL_LEN": "64"}), "4.1.1")
    assert mismatch(baked, longer).startswith("fingerprint mismatch: engine_config")


def test_mismatch_names_the_first_differing_field_unless_ignored(tiny_model):
    here = current_fingerprint(Settings.from_env({"MODEL": tiny_model("tiny-llama"), "DEVICE": "cpu"}), "4.1.1")
    baked = here.from_dict(here.as_dict() | {"driver": "550.1", "criu": "4.0"})
    assert mismatch(baked, here) == f"fingerprint mismatch: driver baked '550.1', here {here.driver!r}"
    assert mismatch(baked, here, ignore=("driver",)) == "fingerprint mismatch: criu baked '4.0', here '4.1.1'"
    assert mismatch(baked, here, ignore=("driver", "criu")) is None


def test_model_hash_follows_the_weights_and_the_layout_content_hash(tiny_model, tmp_path):
    copy = tmp_path / "model"
    shutil.copytree(tiny_model("tiny-llama"), copy)
    before = model_hash(str(copy))
    assert model_hash(str(copy)) == before
    weights = next(copy.glob("*.safetensors"))
    with open(weights, "ab") as f:
        f.write(b"\0" * 8)
    assert model_hash(str(copy)) != before
    (copy / "manifest.json").write_text(json.dumps({"content_hash": "sha256:abc"}))  # a faas-build layout
    assert model_hash(str(copy)) == "sha256:abc"
    assert model_hash(None).startswith("embedded:") and model_hash(None) != "embedded:missing"


def test_criu_prerequisites_say_why_not(monkeypatch):
    assert restore_blockers(None) == ["criu is not installed (scripts/install_criu.sh)"]
    assert any("older than 4.0" in r for r in restore_blockers(Criu("/usr/sbin/criu", "3.17.1")))
    monkeypatch.setenv("AWS_LAMBDA_RUNTIME_API", "127.0.0.1:9001")
    assert "AWS Lambda grants no ptrace or checkpoint/restore capability" in restore_blockers(Criu("c", "4.1.1"))


def test_the_installed_criu_version_is_read_from_its_record_unless_the_binary_is_newer(tmp_path):
    """The bootstrap reads the version install_criu.sh recorded instead of running criu before each restore;
    a binary replaced after the record (or a damaged record) is asked again."""
    import os

    from snapshots.criu import recorded_version

    binary, record = tmp_path / "criu", tmp_path / "VERSION"
    binary.write_text("#!/bin/sh\n")
    record.write_text("4.1.1\n")
    os.utime(binary, (1_000, 1_000))
    assert recorded_version(record, binary) == "4.1.1"
    os.utime(binary, (record.stat().st_mtime + 10,) * 2)
    assert recorded_version(record, binary) is None
    os.utime(binary, (1_000, 1_000))
    record.write_text("criu: not found\n")
    assert recorded_version(record, binary) is None
    assert recorded_version(tmp_path / "missing", binary) is None


def test_several_models_fingerprint_every_model_by_name_and_their_devices(tiny_model, tmp_path):
    llama, qwen = tiny_model("tiny-llama"), tiny_model("tiny-qwen2")

    def fingerprint(model: str, **env: str):
        return current_fingerprint(Settings.from_env({"MODEL": model, "DEVICE": "cpu", **env}), "4.1.1")

    baked = fingerprint(f"a={llama},b={qwen}", POOL_CPU_DEVICES="2")
    assert baked.placements == "a: cpu:0, cpu:1; b: cpu:0, cpu:1"
    assert mismatch(baked, fingerprint(f"b={qwen},a={llama}", POOL_CPU_DEVICES="2")) is None  # the order: no
    assert mismatch(baked, fingerprint(f"a={llama},b={qwen}", POOL_CPU_DEVICES="2", POOL_MEMORY_GB="3")) is None
    copy = tmp_path / "qwen"
    shutil.copytree(qwen, copy)
    with open(next(copy.glob("*.safetensors")), "ab") as f:
        f.write(b"\0" * 8)
    assert mismatch(baked, fingerprint(f"a={llama},b={copy}", POOL_CPU_DEVICES="2")).startswith(
        f"fingerprint mismatch: model_hash of b baked {model_hash(qwen)!r}, here 'sha256:")
    assert mismatch(baked, fingerprint(f"a={llama},c={qwen}", POOL_CPU_DEVICES="2")) == (
        "fingerprint mismatch: models baked a, b, here a, c")
    assert mismatch(baked, fingerprint(f"a={llama},b={qwen}")) == (
        "fingerprint mismatch: placements baked 'a: cpu:0, cpu:1; b: cpu:0, cpu:1', here 'a: cpu; b: cpu'")
    fixed = fingerprint(f"a={llama},b={qwen}", POOL_CPU_DEVICES="2", PLACEMENT="fixed")
    assert fixed.placements == "a: cpu:0; b: cpu:1"
    assert mismatch(baked, fingerprint(f"a={llama},b={qwen}", POOL_CPU_DEVICES="2", PLACEMENT="round-robin")) is None
    assert fingerprint(llama).placements == "" and fingerprint(llama).model_hash == model_hash(llama)


def test_the_bake_asks_ptxas_once_for_each_architecture_nvidia_smi_lists(tmp_path, monkeypatch):
    """A process snapshot is frozen with Triton's answer from `ptxas --version` for each GPU architecture here
    (snapshots/frozen.py), so that the restored runtime's first launch need not run it; without nvidia-smi, or
    where it fails, there is nothing to ask for."""
    pytest.importorskip("triton")
    from triton import knobs
    from triton.backends.nvidia.compiler import get_ptxas_version

    from runtime.engine.kernels import ask_ptxas_for
    from snapshots.fingerprint import gpu_capabilities

    monkeypatch.setenv("PATH", str(tmp_path))
    assert gpu_capabilities() == ()
    smi = tmp_path / "nvidia-smi"
    smi.write_text("#!/bin/sh\nexit 9\n")
    smi.chmod(0o755)
    assert gpu_capabilities() == ()
    smi.write_text("#!/bin/sh\n[ \"$1 $2\" = '--query-gpu=compute_cap --format=csv,noheader' ] || exit 2\n"
                   "printf '9.0\\n9.0\\n8.6\\n'\n")
    assert gpu_capabilities() == (86, 90)
    monkeypatch.undo()
    try:
        knobs.nvidia.ptxas  # noqa: B018
    except RuntimeError:
        pytest.skip("this Triton has no ptxas to ask")
    get_ptxas_version.cache_clear()
    ask_ptxas_for((86, 90))
    asked = get_ptxas_version.cache_info()
    assert asked.currsize == 2
    assert "ptxas" in get_ptxas_version(90).lower()
    after = get_ptxas_version.cache_info()
    assert (after.hits, after.misses) == (asked.hits + 1, asked.misses)
