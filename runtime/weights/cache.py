"""The local disk tier: weight files fetched from S3 are kept here, filled on the way through.

Entries are files under `root/<layout identity>/`; a file appears under its final name only once it is
complete and verified (temporary name, then rename), so a reader never sees half a file. Use is recorded in
the file's mtime; before a new file is written the least recently used weight files are evicted until it fits
under the bound. A file larger than the whole bound is not cached at all.
"""

from __future__ import annotations

import os
import threading
from pathlib import Path

from runtime.logs import get_logger

log = get_logger("weights.cache")

GiB = 1 << 30
_TMP = ".part-"


class DiskCache:
    def __init__(self, root: Path, max_bytes: int) -> None:
        self.root = Path(root)
        self.max_bytes = max_bytes
        self._lock = threading.Lock()
        self._reserved = 0  # files being written by this process (their temporaries are not counted)

    def entry_dir(self, identity: str) -> Path:
        return self.root / identity

    def lookup(self, path: Path) -> bool:
        """Whether a complete cached file is there; marks it as used."""
        try:
            os.utime(path)
            return True
        except FileNotFoundError:
            return False

    def reserve(self, size: int, keep: set[Path] = frozenset()) -> bool:
        """Make room for `size` new bytes by evicting the least recently used files (never those in `keep`).
        False when it cannot fit: the caller streams without caching."""
        if size > self.max_bytes:
            return False
        with self._lock:
            files = self._files()
            used = self._reserved + sum(st.st_size for _, st in files)
            for path, st in sorted(files, key=lambda f: f[1].st_mtime):
                if used + size <= self.max_bytes:
                    break
                if path in keep or not _evictable(path):
                    continue
                path.unlink(missing_ok=True)
                used -= st.st_size
                log.info("disk cache: evicted %s (%.1f MiB)", path.relative_to(self.root), st.st_size / 2**20)
            if used + size > self.max_bytes:
                return False
            self._reserved += size
            return True

    def release(self, size: int) -> None:
        """A reserved file was renamed into place (now counted on disk) or abandoned."""
        with self._lock:
            self._reserved -= size

    def temp_path(self, final: Path) -> Path:
        return final.with_name(f"{_TMP}{os.getpid()}-{threading.get_ident()}-{final.name}")

    def clear_stale(self) -> None:
        """Drop temporaries of runs that died (another process's live ones are not ours to guess at, so only
        those of dead pids)."""
        for path in self.root.glob(f"*/{_TMP}*"):
            pid = path.name[len(_TMP):].split("-", 1)[0]
            if pid.isdigit() and not Path(f"/proc/{pid}").exists():
                path.unlink(missing_ok=True)

    def _files(self) -> list[tuple[Path, os.stat_result]]:
        out = []
        for path in self.root.glob("*/*"):
            if path.name.startswith(_TMP):
                continue  # being written: its writer reserved room for it
            try:
                out.append((path, path.stat()))
            except FileNotFoundError:
                pass
        return out


def _evictable(path: Path) -> bool:
    """Weight data only: an entry's small files (manifest, config, tokenizer) stay, so an entry is always
    resolvable and its evicted weights are streamed again."""
    return path.suffix in (".bin", ".safetensors", ".gguf")
