"""Which restore path the bootstrap takes, and the three restore paths (docs/architecture.md, "Restore paths").

gpu and process are CRIU snapshots: a fresh bootstrap cannot turn itself into the snapshot, so it restores
the snapshot as a child and hands over (`take_over`, before listening), then supervises it. Inside the
restored process the bootstrap runs again; there `restore_gpu` / `restore_process` return the engine the
snapshot holds. materialized runs in the bootstrap's own process.

A path is taken only if its snapshot exists, its fingerprint matches this machine and its prerequisites
hold; otherwise SkipPath(reason). A CRIU restore that fails midway is undone (the restored tree killed) and
the bootstrap starts fresh: no second CRIU attempt.

The paths are tried in the order faas-build measured (runtime/start_paths.py: `read_restore_order`). Where
materialized was measured faster than a CRIU path and its snapshot fits, that CRIU path is not restored:
the bootstrap goes on to the materialized path in its own process.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import TYPE_CHECKING, Callable

from runtime import timeline as stages
from runtime.config import Settings
from runtime.logs import get_logger
from runtime.start_paths import SkipPath, read_restore_order
from runtime.timeline import Timeline
from snapshots import early_restore, stop_during_restore, thawed
from snapshots.criu import Criu, find_criu, restore_blockers
from snapshots.fingerprint import Fingerprint, current_fingerprint, mismatch
from snapshots.image import SEVERAL_MODELS_NO_GPU, ImageError, SnapshotImage
from snapshots.integrity import DigestMismatch, Verification
from snapshots.restore_run import CRIU_KINDS, CRIU_OPTIONS, IMAGES

if TYPE_CHECKING:
    from runtime.engine import Engine
    from runtime.multi_model import BuiltModels
    from snapshots.cudagraph.restore import MaterializedGraphs
    from snapshots.process import CriuHooks

log = get_logger("snapshots.restore")

#: fields a snapshot does not depend on: a process snapshot never touched the GPU
IGNORED_FIELDS = {"gpu": (), "process": ("gpu_model", "driver"), "materialized": ("criu",)}

#: why each CRIU path was not taken by this (non-restored) bootstrap
_skipped: dict[str, str] = {}


def take_over(settings: Settings, argv: list[str]) -> int | None:
    """Restore the fastest CRIU snapshot that fits and serve through it: returns the restored runtime's
    exit status once it ends, or None when no snapshot was restored (the reasons are kept for /health).
    Never raises: a function must start whatever state its snapshots are in."""
    if thawed.current is not None:
        return None  # this is the restored process: the engine is in thawed.current
    stop_during_restore.hold()  # the entry point holds them already; `python -m runtime.bootstrap` does not
    try:
        return _take_over(settings, argv)
    finally:
        early_restore.abandon()  # an early restore this start did not take is undone


def _take_over(settings: Settings, argv: list[str]) -> int | None:
    _skipped.clear()
    from snapshots.driver_primer import start_primer

    start_primer(settings)
    # several models: each model's materialized state is in SNAPSHOT_DIR/name, used beside a process restore
    # or without one (runtime/multi_model.py); no order is measured for them
    several = len(settings.models) > 1
    order = read_restore_order(settings.snapshot_dir).paths if settings.restore == "auto" and not several \
        else CRIU_KINDS
    for position, kind in enumerate(order):
        if kind == "materialized":
            why_not = materialized_unfit(settings)
            if why_not is None:  # measured faster than the CRIU paths after it, and it fits
                for later in order[position + 1:]:
                    _skipped.setdefault(later, "materialized was measured faster and fits")
                return None
            continue
        try:
            criu, image, hooks = _usable(kind, settings)
        except SkipPath as why:
            _skipped[kind] = str(why)
            continue
        except Exception as exc:  # a snapshot damaged in a way nobody foresaw
            _skipped[kind] = f"unusable: {type(exc).__name__}: {exc}"
            continue
        directory = settings.snapshot_dir / kind
        # the image files are hashed on threads while CRIU restores (from the entry point, when it started
        # CRIU); the verdict comes before the hand-over
        verification = (early_restore.take_check(directory / IMAGES, image.digests, image.hash)
                        or image.start_verify(directory))
        running = early_restore.take(kind, criu.path, directory / IMAGES, [*CRIU_OPTIONS, *hooks.criu_options])
        try:
            from snapshots.process import boot_handoff, thaw

            restored = thaw(criu, directory, image, boot_handoff(kind, argv, _skipped, running), hooks,
                            verification, running, settings.criu_feature_cache)
        except DigestMismatch as exc:  # undone by thaw, like any failure; the reason is the file
            log.warning("restore path %s refused, starting fresh: %s", kind, exc)
            _skipped[kind] = str(exc)
            for later in CRIU_KINDS[CRIU_KINDS.index(kind) + 1:]:
                _skipped.setdefault(later, f"not tried after the {kind} restore failed")
            return None
        except Exception as exc:  # undone by thaw; start fresh, once
            log.warning("restore path %s failed, starting fresh: %s", kind, exc)
            _skipped[kind] = f"failed: {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
            for later in order[position + 1:]:
                if later in CRIU_KINDS:
                    _skipped.setdefault(later, f"not tried after the {kind} restore failed")
            return None
        from runtime.weights import prefetch
        from snapshots.supervise import supervise

        prefetch.widen()  # handed over: the restore's own reads are done, the weights have the disk
        pid, restore_s = restored.wait()
        return supervise(pid, restored.lazy_pages, restored.started + restore_s)
    return None


def _usable(kind: str, settings: Settings) -> tuple[Criu, SnapshotImage, "CriuHooks"]:
    """(criu, image, hooks) for a CRIU snapshot that can be restored here, else SkipPath(why not)."""
    if settings.restore not in ("auto", kind):
        raise SkipPath(f"RESTORE={settings.restore}")
    if kind == "gpu" and len(settings.models) > 1:
        raise SkipPath(SEVERAL_MODELS_NO_GPU)
    if settings.snapshot_dir is None:
        raise SkipPath("SNAPSHOT_DIR is not set")
    directory = settings.snapshot_dir / kind
    try:
        image = SnapshotImage.read(directory)
        image.check_files(directory)
    except ImageError as why:
        raise SkipPath(str(why)) from None
    for model_dir in image.sources():  # the restored engines load their weights from there
        if not Path(model_dir).exists():
            raise SkipPath(f"the model it was baked from, {model_dir}, is not here")
    criu = find_criu()
    blockers = restore_blockers(criu, image.pid_namespace)
    if blockers:
        raise SkipPath("; ".join(blockers))
    check_fingerprint(image.fingerprint, current_fingerprint(settings, criu.version), kind)
    return criu, image, _hooks(kind, settings)


def restore_gpu(settings: Settings, timeline: Timeline) -> "Engine":
    """The started engine the snapshot holds; if the image left its weights out, they have been streaming
    back since (or during) the restore (snapshots/frozen.py) and the engine is ready once they are in."""
    engine = _restored_engine("gpu", timeline)
    current = thawed.current
    if current.weights is not None:
        started, detail = current.weights.wait()
        timeline.record(stages.WEIGHTS, started, time.time(), **detail)
        current.weights = None
    return engine


def restore_process(settings: Settings, timeline: Timeline) -> "Engine":
    engine = _restored_engine("process", timeline)
    try:
        kv_blocks, graphs = materialized_state(settings, timeline)
    except SkipPath as why:
        log.info("process path without materialized state: %s", why)
        kv_blocks, graphs = None, None
    handover, thawed.current.handover = thawed.current.handover, None
    try:
        engine.start(kv_blocks=kv_blocks, graph_restorer=graphs, handover=handover)
    finally:
        if handover is not None:
            handover.close()  # the helper frees its memory at once, whether or not it was taken
    return engine


def restore_materialized(settings: Settings, timeline: Timeline, build: Callable[[], "Engine"]) -> "Engine":
    """A fresh engine (BUILD: the cold path's CPU phase) started with the baked KV size and graphs. The
    snapshot's files are checked on threads while the engine is built, and used only if they pass."""
    verification = _start_verify(_materialized_dir(settings))
    engine = build()
    kv_blocks, graphs = materialized_state(settings, timeline, verification)
    engine.start(kv_blocks=kv_blocks, graph_restorer=graphs)
    return engine


def materialized_unfit(settings: Settings) -> str | None:
    """Why the materialized snapshot cannot be used here, or None if it can (its fingerprint only: cheap)."""
    try:
        _materialized_dir(settings)
    except SkipPath as why:
        return str(why)
    except (OSError, ValueError, KeyError, TypeError) as exc:
        return f"unusable: {type(exc).__name__}: {exc}"
    return None


def _materialized_dir(settings: Settings, pooled: bool = False) -> Path:
    from snapshots.materialized import DIRNAME, FINGERPRINT, baked_pooled

    if settings.snapshot_dir is None:
        raise SkipPath("SNAPSHOT_DIR is not set")
    directory = settings.snapshot_dir / DIRNAME
    if not (directory / FINGERPRINT).is_file():
        raise SkipPath(f"no materialized snapshot in {settings.snapshot_dir}")
    if baked_pooled(directory) != pooled:  # its graphs point into a KV cache of another shape
        raise SkipPath("baked for a model served alone, not for a several-model instance's pool (faas-build "
                       "--model name=...,name=... bakes that)" if pooled else
                       "baked for a several-model instance's pool, not for a model served alone")
    baked = Fingerprint.from_dict(json.loads((directory / FINGERPRINT).read_text()))
    check_fingerprint(baked, current_fingerprint(settings), "materialized")
    return directory


def materialized_state(settings: Settings, timeline: Timeline, verification: Verification | None = None,
                       pooled: bool = False) -> tuple[int, "MaterializedGraphs"]:
    """(KV blocks, graph restorer) from `<SNAPSHOT_DIR>/materialized`, if it is there, fits and every file
    matches its baked digest (VERIFICATION: that check, started earlier). POOLED: for a model of a
    several-model instance, whose graphs must have been baked against its KV cache in the pool."""
    from snapshots.cudagraph.restore import MaterializedGraphs
    from snapshots.materialized import load_kv_blocks

    directory = _materialized_dir(settings, pooled)
    verification = verification or _start_verify(directory)
    graphs = MaterializedGraphs(directory, settings.graphs_before_ready)
    graphs.read_ahead()  # beside the check; used only once it has passed
    try:
        verification.wait()
    except DigestMismatch as why:
        raise SkipPath(str(why)) from None
    finally:
        timeline.record(stages.SNAPSHOT_VERIFY, verification.started, verification.ended or time.time(),
                        snapshot="materialized", bytes=verification.bytes)
    return load_kv_blocks(directory), graphs


def _start_verify(directory: Path) -> Verification:
    from snapshots.materialized import DIGESTS

    try:
        baked = json.loads((directory / DIGESTS).read_text())
        files, hash = dict(baked["files"]), str(baked["hash"])
    except FileNotFoundError:
        raise SkipPath("the materialized snapshot has no digests of its files (baked by an older faas-build): "
                       "bake it again") from None
    except (ValueError, KeyError, TypeError) as exc:
        raise SkipPath(f"unreadable {directory / DIGESTS}: {exc}") from None
    unlisted = sorted(p.name for p in directory.iterdir() if p.is_file() and p.name not in files
                      and p.name != DIGESTS)
    if unlisted:
        raise SkipPath(f"materialized snapshot file {unlisted[0]} was not baked (added after the bake)")
    return Verification.start(directory, files, hash, "materialized snapshot file")


def check_fingerprint(baked: Fingerprint, here: Fingerprint, kind: str) -> None:
    why = mismatch(baked, here, IGNORED_FIELDS[kind])
    if why:
        raise SkipPath(why)


def _restored_engine(kind: str, timeline: Timeline) -> "Engine":
    current = _restored(kind, timeline)
    if current.engine is None:  # the fingerprint keeps a several-model image from a lone model's boot
        raise SkipPath(f"the {kind} snapshot holds several models")
    current.engine.timeline = timeline
    return current.engine


def restored_models(timeline: Timeline, skipped: dict[str, str]) -> "BuiltModels":
    """Several models: the engines the restored process snapshot holds (this process was restored from it),
    else SkipPath(why not). SKIPPED gets why the gpu path was not taken."""
    skipped["gpu"] = _why_not("gpu") or "a several-model instance restores no gpu snapshot"
    current = _restored("process", timeline)
    if current.models is None:
        raise SkipPath("the process snapshot holds one model")
    for engines in current.models.engines.values():
        for engine in engines.values():
            engine.timeline = timeline
    return current.models


def _why_not(kind: str) -> str | None:
    """Why this process does not hold a restored KIND snapshot; None when it does."""
    current = thawed.current
    if current is None:
        return _skipped.get(kind, "SNAPSHOT_DIR is not set")
    if current.kind != kind:
        return current.handoff.skipped.get(kind, f"the {current.kind} snapshot was restored")
    return None


def _restored(kind: str, timeline: Timeline) -> thawed.Thawed:
    """What the restored KIND snapshot holds, its restore and check recorded on TIMELINE; else SkipPath."""
    why = _why_not(kind)
    if why is not None:
        raise SkipPath(why)
    current = thawed.current
    # bootstrap_s: the bootstrap's second run, inside the restored process, from the hand-over to this path
    timeline.record(stages.RESTORE, current.handoff.restore_started, current.taken_over_at, snapshot=kind,
                    **current.handoff.restore_detail, bootstrap_s=round(time.time() - current.taken_over_at, 4))
    if current.handoff.verify_span:  # the image files' check, beside the restore and before the hand-over
        started, ended, nbytes = current.handoff.verify_span
        timeline.record(stages.SNAPSHOT_VERIFY, started, ended, snapshot=kind, bytes=int(nbytes))
    return current


def _hooks(kind: str, settings: Settings) -> "CriuHooks":
    if kind == "process":
        from snapshots.process import process_hooks

        return process_hooks(settings.weights_during_restore, settings.lazy_pages, settings.weights_memory_first,
                             settings.embedding_last)
    from snapshots.gpu import gpu_hooks

    # raises SkipPath without cuda-bindings
    return gpu_hooks(settings.weights_during_restore, settings.weights_memory_first)
