"""The files of a materialized snapshot (snapshots/materialized.py) as the restore paths read them, without
importing torch: the bootstrap checks them beside a process snapshot's image (snapshots/restore.py) before
anything imports it."""

from __future__ import annotations

import json
from pathlib import Path

DIRNAME = "materialized"
#: the Fingerprint (snapshots/fingerprint.py) it was baked against; the restore paths check it
FINGERPRINT = "fingerprint.json"
#: {"hash": ..., "files": {name: digest}} of every other file, written last
DIGESTS = "digests.json"


def write_digests(directory: Path) -> None:
    from snapshots.integrity import HASH, digest_files

    names = sorted(p.name for p in directory.iterdir() if p.is_file() and p.name != DIGESTS)
    (directory / DIGESTS).write_text(json.dumps({"hash": HASH, "files": digest_files(directory, names)}, indent=1))


def load_kv_blocks(directory: Path) -> int:
    return json.loads((directory / "kvprofile.json").read_text())["num_blocks"]


def baked_pooled(directory: Path) -> bool:
    """Whether the state was baked for a model of a several-model instance (its KV cache the pool's)."""
    return bool(json.loads((directory / "kvprofile.json").read_text()).get("pooled", False))
