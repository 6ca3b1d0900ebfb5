"""Whole-file digests: what a layout's small files and a snapshot's files are checked against before they are
used. The hashes are the layout chunks' (runtime/weights/manifest.py says why xxh3-128 by default); the files
are hashed on parallel threads, which the hashes allow (each releases the GIL on large buffers). Imports
neither torch nor numpy: a snapshot's files are checked before either is loaded."""

from __future__ import annotations

import hashlib
import mmap
import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Iterable, Mapping

DEFAULT_THREADS = 8
#: digests of a file's parts: hash name -> (the hash of each part and of their digests, the part's bytes).
#: A file's digest is the hash of its parts' digests in order, so one large file (a CRIU page image of
#: 300 MB) is hashed on every thread instead of one
PARTED = {"xxh3-128-parts": ("xxh3-128", 32 << 20)}


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
    if hash in PARTED:
        return file_digests([path], hash, threads=1)[path]
    return _hash_range(path, 0, None, new_hasher(hash)).hexdigest()


def file_digests(paths: Iterable[Path], hash: str, threads: int = DEFAULT_THREADS) -> dict[Path, str]:
    sizes = {p: os.stat(p).st_size for p in paths}
    # the largest first, so that one big file does not start last and finish alone
    paths = sorted(sizes, key=lambda p: -sizes[p])
    if hash not in PARTED:
        with ThreadPoolExecutor(max(1, min(threads, len(paths)))) as pool:
            return dict(zip(paths, pool.map(lambda p: file_digest(p, hash), paths)))
    part_hash, part_bytes = PARTED[hash]
    parts = [(p, start) for p in paths for start in range(0, max(sizes[p], 1), part_bytes)]
    with ThreadPoolExecutor(max(1, min(threads, len(parts)))) as pool:
        digests = pool.map(lambda part: _hash_range(part[0], part[1], part_bytes, new_hasher(part_hash)).digest(),
                           parts)
        joined: dict[Path, list[bytes]] = {p: [] for p in paths}
        for (path, _), digest in zip(parts, digests):
            joined[path].append(digest)
    out = {}
    for path, part_digests in joined.items():
        h = new_hasher(part_hash)
        h.update(b"".join(part_digests))
        out[path] = h.hexdigest()
    return out


def _hash_range(path: Path, start: int, length: int | None, h):
    """H updated with LENGTH bytes of PATH from START (None: to the end), mapped and hashed in one call, which
    releases the GIL for all of it. Read in blocks instead, each block's read and hash took the GIL back, and
    beside a busy main thread (the bootstrap's imports, at a restore) each of those waited for it:
    scripts/bench_digest_contention.py. The files checked are replaced whole, never truncated in place (a
    mapping read past a file's new end would be a SIGBUS): snapshot images, and layout files written by rename."""
    with open(path, "rb", buffering=0) as f:
        size = os.fstat(f.fileno()).st_size
        end = size if length is None else min(size, start + length)
        if end > start:
            with mmap.mmap(f.fileno(), end - start, offset=start, access=mmap.ACCESS_READ) as mapped:
                h.update(mapped)
    return h


def mismatched(directory: Path, expected: Mapping[str, str], hash: str, threads: int = DEFAULT_THREADS) -> list[str]:
    """Names (relative to DIRECTORY) of the files in EXPECTED that are missing or whose digest differs."""
    present = {name: directory / name for name in expected if (directory / name).is_file()}
    missing = sorted(set(expected) - set(present))
    if not present:
        return missing
    got = file_digests(present.values(), hash, threads)
    return missing + sorted(name for name, path in present.items() if got[path] != expected[name])
