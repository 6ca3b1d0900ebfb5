"""Whole-file digests: what a layout's small files and a snapshot's files are checked against before they are
used. The hashes are the layout chunks' (runtime/weights/manifest.py says why xxh3-128 by default); the files
are hashed on parallel threads, which the hashes allow (each releases the GIL on large buffers). Imports
neither torch nor numpy: a snapshot's files are checked before either is loaded."""

from __future__ import annotations

import hashlib
import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Iterable, Mapping

BLOCK = 8 << 20
DEFAULT_THREADS = 8


def new_hasher(name: str):
    """A new hash object of `name` (xxh3-128, blake3 or sha256)."""
    if name == "xxh3-128":
        import xxhash

        return xxhash.xxh3_128()
    if name == "blake3":
        import blake3

        return blake3.blake3(max_threads=1)  # the callers' threads are the parallelism
    return hashlib.sha256()


def file_digest(path: Path, hash: str) -> str:
    h = new_hasher(hash)
    with open(path, "rb", buffering=0) as f:
        buf = bytearray(BLOCK)
        view = memoryview(buf)
        while n := f.readinto(buf):
            h.update(view[:n])
    return h.hexdigest()


def file_digests(paths: Iterable[Path], hash: str, threads: int = DEFAULT_THREADS) -> dict[Path, str]:
    paths = list(paths)
    # the largest first, so that one big file does not start last and finish alone
    paths.sort(key=lambda p: -os.stat(p).st_size)
    with ThreadPoolExecutor(max(1, min(threads, len(paths)))) as pool:
        return dict(zip(paths, pool.map(lambda p: file_digest(p, hash), paths)))


def mismatched(directory: Path, expected: Mapping[str, str], hash: str, threads: int = DEFAULT_THREADS) -> list[str]:
    """Names (relative to DIRECTORY) of the files in EXPECTED that are missing or whose digest differs."""
    present = {name: directory / name for name in expected if (directory / name).is_file()}
    missing = sorted(set(expected) - set(present))
    if not present:
        return missing
    got = file_digests(present.values(), hash, threads)
    return missing + sorted(name for name, path in present.items() if got[path] != expected[name])
