"""The CRIU restore the entry point starts before the bootstrap is imported (runtime/entry.py).

What a start from a CRIU snapshot waits for first is CRIU itself (0.2-0.4 s on the H100 machine), yet the
bootstrap reached it only after its imports, its settings and the snapshot's checks (0.11-0.16 s from
spawn). So the entry point reads the settings that decide which snapshot would be restored first and how
(RESTORE, SNAPSHOT_DIR, MODEL, LAZY_PAGES and CRIU_FEATURE_CACHE, from the command line or the environment, as
text), starts `criu restore` for it and only then imports the bootstrap. The bootstrap parses every setting
and checks the snapshot as it always does (snapshots/restore.py: `take_over`) and `take`s this restore where it
would have started the same one; anything else `abandon`s it: CRIU is waited for and what it restored is killed
before the start goes on. The restored process gets its instance only through the hand-over, after those checks
and the image's digests have passed, so starting early changes when CRIU runs, never what is restored or served.

It also starts the check of that snapshot's image files against the digests in its manifest, on threads,
right after CRIU, or once `site` has run in an entry point started without it (snapshots/integrity.py); the
bootstrap `take_check`s it where it would check the same files against the same digests, and the hand-over
waits for its verdict as it would for its own.

Imports before CRIU starts: os, json (the order faas-build measured) and what the interpreter has loaded at start.
"""

from __future__ import annotations

import json
import os

from runtime.setting_text import early_flag, setting
from runtime.start_paths import read_restore_order
from snapshots.restore_run import (CRIU_ENV, CRIU_KINDS, CRIU_OPTIONS, IMAGES, INSTALLED_CRIU, MANIFEST, RestoreRun,
                                   image_file_problem, kind_options)

TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Mapping, Sequence

    from snapshots.integrity import Verification

#: the restore `start` began, until the bootstrap takes it or abandons it
_running: RestoreRun | None = None
_kind: str | None = None
#: the check of its image files against their digests, begun right after it, until the bootstrap takes it
_check: "Verification | None" = None
#: what that check needs, while `start_check` has not begun it
_unchecked: tuple[str, str, dict] | None = None


def start(argv: Sequence[str], environ: Mapping[str, str] = os.environ, check: bool = True) -> str | None:
    """Start restoring the snapshot the bootstrap would restore first, if there is one to restore, and
    unless CHECK is False the check of its image files (`start_check` begins it then); returns its kind.
    Never raises: without an early restore the bootstrap restores as it always did."""
    global _running, _kind, _unchecked
    try:
        kind = first_kind(argv, environ)
        criu = environ.get(CRIU_ENV) or INSTALLED_CRIU
        if kind is None or not os.access(criu, os.X_OK):
            return None
        snapshot_dir = os.path.expanduser(setting(argv, environ, "SNAPSHOT_DIR"))
        with open(os.path.join(snapshot_dir, kind, MANIFEST)) as f:
            manifest = json.load(f)
        images = os.path.join(snapshot_dir, kind, IMAGES)
        if image_file_problem(images, manifest["files"]) is not None:
            return None  # the bootstrap says why; CRIU can hang on a truncated image
        lazy = early_flag(argv, environ, "LAZY_PAGES")
        features = manifest.get("kernel_features") if early_flag(argv, environ, "CRIU_FEATURE_CACHE") else None
        _running = RestoreRun(criu, images, manifest["snapshot_id"], (*CRIU_OPTIONS, *kind_options(kind, lazy)),
                              features)
        _kind = kind
        _unchecked = (kind, images, manifest)
        if check:
            start_check()
        return kind
    except Exception:  # noqa: BLE001 - the bootstrap's own restore reports what is wrong
        return None


def start_check() -> None:
    """Hash the image files of the restore `start` began against its manifest's digests on threads, from now,
    if `start` did not (the entry point started without `site` calls this once `site` has run: the check hashes
    with xxhash). With lazy pages the hand-over waits for this verdict rather than for CRIU, and the bootstrap
    would begin it only after its imports. A check that cannot start is the bootstrap's to start."""
    global _check, _unchecked
    unchecked, _unchecked = _unchecked, None
    if unchecked is None:
        return
    kind, images, manifest = unchecked
    digests, hash = manifest.get("digests"), manifest.get("hash")
    if not (isinstance(digests, dict) and digests and isinstance(hash, str) and hash):
        return  # a snapshot without digests: the bootstrap refuses it
    try:
        from snapshots.integrity import Verification  # after CRIU has started: not on its way

        _check = Verification.start(images, digests, hash, f"{kind} snapshot image file")
    except Exception:  # noqa: BLE001 - the bootstrap checks the files itself
        _check = None


def take_check(images: str | os.PathLike, digests: Mapping[str, str], hash: str) -> "Verification | None":
    """The early check of the image files, now the caller's, if it checks IMAGES against exactly DIGESTS with
    HASH (what the bootstrap read from the manifest); otherwise None."""
    global _check
    check, _check = _check, None
    if check is None or os.path.realpath(check.directory) != os.path.realpath(images):
        return None
    return check if (dict(check.expected), check.hash) == (dict(digests), hash) else None


def first_kind(argv: Sequence[str], environ: Mapping[str, str]) -> str | None:
    """The CRIU snapshot the bootstrap would try first: RESTORE's, or under auto the first CRIU path of the
    order faas-build measured (none if materialized comes first); None where no CRIU restore would start."""
    if not early_flag(argv, environ, "EARLY_RESTORE"):
        return None
    restore = setting(argv, environ, "RESTORE") or "auto"
    snapshot_dir = os.path.expanduser(setting(argv, environ, "SNAPSHOT_DIR") or "")
    model = setting(argv, environ, "MODEL") or ""
    if not snapshot_dir or environ.get("AWS_LAMBDA_RUNTIME_API") or "," in model:
        return None  # several models restore a process snapshot and their pools: left to the bootstrap
    if restore in CRIU_KINDS:
        order = (restore,)
    elif restore == "auto":
        order = read_restore_order(snapshot_dir).paths
    else:
        return None
    for kind in order:
        if kind not in CRIU_KINDS:
            return None
        if os.path.isdir(os.path.join(snapshot_dir, kind, IMAGES)):
            return kind
    return None


def take(kind: str, criu_path: str, images: str | os.PathLike, options: Sequence[str]) -> RestoreRun | None:
    """The early restore, now the caller's, if it is KIND's restore of IMAGES by CRIU_PATH with OPTIONS;
    otherwise it is abandoned and None."""
    global _running, _kind
    running, started_kind = _running, _kind
    _running = _kind = None
    if running is None:
        return None
    if started_kind == kind and running.matches(criu_path, images, options):
        return running
    running.undo()
    return None


def abandon() -> None:
    """Undo the early restore, if one was started and not taken: nothing it restored is left running."""
    global _running, _kind, _check, _unchecked
    running, _running, _kind, _check, _unchecked = _running, None, None, None, None
    if running is not None:
        running.undo()
