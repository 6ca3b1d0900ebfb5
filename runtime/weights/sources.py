"""Where the loader reads one layout file from: the local disk (a layout directory or the disk cache), or S3
with the disk cache filled on the way through."""

from __future__ import annotations

import os
import threading
from pathlib import Path

import orjson

from runtime.weights.cache import DiskCache
from runtime.weights.errors import WeightsError
from runtime.weights.manifest import FileEntry, Manifest
from runtime.weights.s3 import S3Store, join_key, split_url


class LocalFile:
    tier = "disk"
    small_reads = True  # a preadv costs microseconds: the loader may read a piece in hash windows

    def __init__(self, path: Path) -> None:
        self.path = path
        self.fd = os.open(path, os.O_RDONLY)
        size = os.fstat(self.fd).st_size
        self.size = size

    def read_into(self, offset: int, out: memoryview) -> None:
        got = 0
        while got < len(out):
            n = os.preadv(self.fd, [out[got:]], offset + got)
            if n == 0:
                raise WeightsError(f"{self.path}: truncated ({self.size} bytes, needed {offset + len(out)})")
            got += n

    def chunk_verified(self, chunk: int) -> None:
        pass

    def close(self, ok: bool) -> None:
        os.close(self.fd)


class S3File:
    """Ranged GETs of `url/name`; each verified chunk is also written to a temporary cache file, which is
    renamed into place once every chunk of the file has been verified."""

    tier = "s3"
    small_reads = False  # one ranged GET per piece, never one per hash window

    def __init__(self, store: S3Store, url: str, entry: FileEntry, cache: DiskCache | None, final: Path | None):
        self.store = store
        self.bucket, prefix = split_url(url)
        self.key = join_key(prefix, entry.name)
        self.final = final
        self.cache = cache
        self._pending = len(entry.chunks())
        self.size = entry.size
        self._lock = threading.Lock()
        self._fd = None
        if cache is not None and final is not None:
            self._temp = cache.temp_path(final)
            self._fd = os.open(self._temp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            os.ftruncate(self._fd, entry.size)

    def read_into(self, offset: int, out: memoryview) -> None:
        self.store.read_into(self.bucket, self.key, offset, out)
        if self._fd is not None:
            os.pwrite(self._fd, out, offset)

    def chunk_verified(self, chunk: int) -> None:
        with self._lock:
            self._pending -= 1

    def close(self, ok: bool) -> None:
        if self._fd is None:
            return
        os.close(self._fd)
        self._fd = None
        if ok and self._pending == 0:
            os.rename(self._temp, self.final)
        else:
            os.unlink(self._temp)
        self.cache.release(self.size)


ORIGIN = "origin.json"


def open_sources(layout_dir: Path, manifest: Manifest, cache: DiskCache | None, store: S3Store | None) -> list:
    """One source per layout file: the local file when it is there, else the layout's S3 origin."""
    origin = _origin(layout_dir)
    if origin is not None:
        store = store or S3Store()
    sources = []
    try:
        for entry in manifest.files:
            path = layout_dir / entry.name
            if cache.lookup(path) if cache is not None else path.is_file():
                sources.append(LocalFile(path))
            elif origin is not None:
                use_cache = cache is not None and cache.reserve(
                    entry.size, keep={layout_dir / f.name for f in manifest.files})
                sources.append(S3File(store, origin, entry, cache if use_cache else None, path))
            else:
                raise WeightsError(f"{layout_dir}: {entry.name} is missing")
    except BaseException:
        for source in sources:
            source.close(False)
        raise
    return sources


def _origin(layout_dir: Path) -> str | None:
    path = layout_dir / ORIGIN
    return orjson.loads(path.read_bytes())["url"] if path.is_file() else None
