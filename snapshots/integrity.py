"""Every file of a snapshot has a digest taken at bake time, written last in its manifest, and is checked
against it before the snapshot is handed over: a file damaged or changed after the bake (a same-size edit
of a CRIU page image included) makes the restore path fall back, with the file named.

The check runs on threads beside the restore (`Verification.start`, then `wait()` at the last moment before
the restored runtime gets its instance), hashing files in parallel with the layout chunks' hash
(runtime/weights/file_digest.py). Like the layout's chunk hashes it guards against accidents and edits of the
files, not against someone who can rewrite the manifest too.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Mapping

from runtime.weights.file_digest import file_digests, mismatched

#: xxh3-128 over 32 MiB parts, each part on a thread of its own (runtime/weights/file_digest.py: PARTED); a
#: snapshot baked with whole-file "xxh3-128" digests is checked with those
HASH = "xxh3-128-parts"


class DigestMismatch(RuntimeError):
    """A snapshot file is missing or differs from the bake; the message names it."""


def digest_files(directory: Path, names: list[str], hash: str = HASH) -> dict[str, str]:
    paths = [directory / name for name in names]
    digests = file_digests(paths, hash) if paths else {}
    return {name: digests[directory / name] for name in names}


@dataclass
class Verification:
    """The check of DIRECTORY's files against EXPECTED (name -> digest), on a thread of its own."""

    directory: Path
    expected: Mapping[str, str]
    hash: str
    what: str  # names the snapshot in the message: "process snapshot image file"
    started: float = 0.0
    ended: float = 0.0
    bytes: int = 0
    _bad: list[str] = field(default_factory=list)
    _error: BaseException | None = None
    _thread: threading.Thread | None = None

    @classmethod
    def start(cls, directory: Path, expected: Mapping[str, str], hash: str, what: str) -> "Verification":
        check = cls(Path(directory), dict(expected), hash, what)
        check.started = time.time()
        check._thread = threading.Thread(target=check._run, name="snapshot-verify", daemon=True)
        check._thread.start()
        return check

    def _run(self) -> None:
        try:
            self.bytes = sum((self.directory / n).stat().st_size for n in self.expected
                             if (self.directory / n).is_file())
            self._bad = mismatched(self.directory, self.expected, self.hash)
        except BaseException as exc:  # noqa: BLE001 - handed to wait()
            self._error = exc
        self.ended = time.time()

    def wait(self) -> None:
        """Returns once every file matched; raises DigestMismatch naming the first that did not."""
        self._thread.join()
        if self._error is not None:
            raise DigestMismatch(f"{self.what}s could not be checked: {self._error}")
        if self._bad:
            more = f" (and {len(self._bad) - 1} more)" if len(self._bad) > 1 else ""
            raise DigestMismatch(f"{self.what} {self._bad[0]} does not match its {self.hash} digest from the "
                                 f"bake{more}: the snapshot was changed after it was baked")

    def span(self) -> list[float]:
        """[start, end, bytes] for the restored process's timeline (the handoff carries it)."""
        return [self.started, self.ended, float(self.bytes)]
