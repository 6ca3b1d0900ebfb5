"""Process snapshots: a CRIU image of the runtime after imports, settings, tokenizer and engine
construction on the meta device, before CUDA is initialised (docs/architecture.md, "Snapshots"); with several
models (a MODEL list), of every model's engine on each device its placement gives it.

`bake_process_snapshot` (faas-build) freezes such a runtime, dumps it into `<snapshot dir>/process/`,
restores it once to check the image works, and only then renames the directory into place. `thaw` is the
boot side, shared with gpu snapshots: restore, (hook), hand over, leave the process running.
"""

from __future__ import annotations

import os
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Callable

from runtime.config import Settings
from runtime.logs import get_logger
from runtime.timeline import process_start_time
from snapshots import checkpoint, handoff, kernel_features
from snapshots.checkpoint import SnapshotError
from snapshots.criu import Criu, find_criu, restore_blockers
from snapshots.fingerprint import current_fingerprint, resolved_device
from snapshots.image import IMAGES, SnapshotImage, list_image_files
from snapshots.integrity import HASH, Verification, digest_files
from snapshots.restore_run import RestoreRun, kind_options

if TYPE_CHECKING:
    from snapshots.cuda_checkpoint import RestoreHelper

log = get_logger("snapshots.process")

#: how long a restored process may take to answer the handoff
HANDOFF_TIMEOUT_S = 30.0


@dataclass
class CriuHooks:
    """What a kind of snapshot adds around CRIU (gpu: the CUDA checkpoint and restore)."""

    before_dump: Callable[[int], None] | None = None
    #: started before CRIU restores, so that its own start-up overlaps the restore; given the restored pid.
    #: Called with the image and whether this restore is a boot (not the bake's check that it restores);
    #: None: no helper for this restore.
    start_restore_helper: Callable[[SnapshotImage, bool], "RestoreHelper | None"] | None = None
    criu_options: list[str] = field(default_factory=list)


def bake_process_snapshot(settings: Settings, model_dir: Path | None, snapshot_dir: Path,
                          pid_namespace: bool | None = None) -> SnapshotImage:
    """Bake `<snapshot_dir>/process/`. SETTINGS are the function's as it will boot (MODEL as at boot: the
    fingerprint hashes it); MODEL_DIR is the local model directory or layout the engine is built from (None
    for several models: each model's reference in MODEL is its local directory).
    PID_NAMESPACE True freezes the runtime as the init of its own pid namespace (no pid clash at restore;
    needs CAP_SYS_ADMIN); False restores with the baked pids (a restore whose pids are taken fails and falls
    back); None (default): True on CPU, False where the runtime will use the GPU (see bake_snapshot)."""
    return bake_snapshot("process", settings, model_dir, snapshot_dir, CriuHooks(), pid_namespace)


def process_hooks(weights_during_restore: str, lazy_pages: bool, memory_first: bool = True,
                  embedding_last: bool = False) -> CriuHooks:
    """At boot, a process snapshot of a CUDA engine gets its weights from a helper that streams them while
    CRIU restores (WEIGHTS_DURING_RESTORE; snapshots/weights_during_restore.py): with `auto`, when they are not
    in the page cache. On the H100 machine, from cold disk, the helper read them at the disk's full rate from
    0.7 s after spawn, while the restored runtime's own CUDA context took 1.2-3.3 s to make (its libraries read
    from disk too); from the page cache, the restored runtime loaded them itself 0.3 s sooner: the helper's CUDA
    context takes as long to make as the runtime's, and the copy from the page cache is not what waits.
    The helper hands its memory over before it streams unless MEMORY_FIRST is False (WEIGHTS_MEMORY_FIRST), and
    with EMBEDDING_LAST leaves the embedding table's whole chunks to the restored runtime.
    Several models: no helper (their weights go into pool memory, mapped only once the pool exists).
    LAZY_PAGES: the restore hands over before the memory is back (snapshots/restore_run.py: LAZY_OPTIONS)."""
    options = list(kind_options("process", lazy_pages))
    if weights_during_restore == "never":
        return CriuHooks(criu_options=options)

    def start_weights_helper(image: SnapshotImage, boot: bool) -> "RestoreHelper | None":
        if not boot or image.engine_device().split(":")[0] != "cuda":
            return None
        if image.model_dirs:
            log.info("process snapshot of %d models: no helper streams weights during the restore (each model's "
                     "weights stream into its pool when it is made resident)", len(image.model_dirs))
            return None
        from runtime.weights.residency import CACHED_ENOUGH, cached_fraction, files_in

        cached = cached_fraction(files_in(Path(image.model_dir)))
        if weights_during_restore == "auto" and cached is not None and cached >= CACHED_ENOUGH:
            log.info("process snapshot: %.0f%% of the weights in the page cache: the restored runtime loads them",
                     100 * cached)
            return None
        from runtime.cuda_driver import bindings_installed

        if not bindings_installed():  # after the cheap check: looking the package up costs milliseconds
            return None
        from snapshots.cuda_checkpoint import RestoreHelper

        log.info("process snapshot: %s of the weights in the page cache: a helper streams them during the restore",
                 "an unknown share" if cached is None else f"{100 * cached:.0f}%")
        return RestoreHelper(Path(image.model_dir), cuda_restore=False, memory_first=memory_first,
                             embedding_last=embedding_last)

    return CriuHooks(start_restore_helper=start_weights_helper, criu_options=options)


def bake_snapshot(kind: str, settings: Settings, model_dir: Path | None, snapshot_dir: Path, hooks: CriuHooks,
                  pid_namespace: bool | None = None, weights_left_out: bool = False) -> SnapshotImage:
    device = resolved_device(settings)
    if pid_namespace is None:
        # CUDA does not initialise inside a new pid namespace (cudaGetDeviceCount: error 304, seen on the
        # H100 machine), so a runtime that will use the GPU is frozen and restored with its own pids.
        pid_namespace = device != "cuda"
    criu = find_criu()
    blockers = restore_blockers(criu, pid_namespace)
    if blockers:
        raise SnapshotError(f"cannot bake a {kind} snapshot here: {'; '.join(blockers)}")
    snapshot_dir.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{kind}-", dir=snapshot_dir))
    os.chmod(tmp, 0o755)
    try:
        started = time.time()
        several = {m.name: str(m.ref) for m in settings.models} if model_dir is None else {}
        log.info("%s snapshot: starting the runtime to freeze (%s)", kind, model_dir or settings.model)
        # DEVICE decided here: the frozen runtime must not probe the GPU to resolve auto (process snapshots
        # are taken before CUDA is initialised)
        environ = checkpoint.settings_environ(settings) | {"DEVICE": device}
        frozen = checkpoint.freeze_runtime(kind, model_dir, environ, tmp, pid_namespace)
        build_s = time.time() - started
        log.info("%s snapshot: runtime ready in %.1f s; checkpointing pid %d", kind, build_s, frozen.pid)
        if hooks.before_dump is not None:
            hooks.before_dump(frozen.pid)
        kernel_features.withdraw()  # a dump must probe: the record's zero page and shmem device are one boot's
        dump_s = checkpoint.dump(criu, frozen, tmp, hooks.criu_options)
        files = list_image_files(tmp)
        digested = time.time()
        digests = digest_files(tmp / IMAGES, sorted(files))
        features, why_not = kernel_features.probe(criu.path)
        if features is None:
            log.warning("%s snapshot: no record of the kernel's features for criu (each restore probes them): %s",
                        kind, why_not)
        image = SnapshotImage(kind=kind, snapshot_id=frozen.snapshot_id,
                              fingerprint=current_fingerprint(settings, criu.version),
                              model_dir=str(model_dir or ""), model_dirs=several,
                              files=files, baked_at=time.time(), dump_s=round(dump_s, 3),
                              verify_restore_s=0.0, timings={"build_s": round(build_s, 3),
                                                             "digest_s": round(time.time() - digested, 3)},
                              pid_namespace=pid_namespace, weights_left_out=weights_left_out, hash=HASH,
                              digests=digests, kernel_features=features or {})
        log.info("%s snapshot: dumped %.0f MB in %.2f s; checking that it restores", kind,
                 image.size_bytes / 1e6, dump_s)
        image.verify_restore_s = round(verify_restores(criu, tmp, image, hooks), 3)
        image.write(tmp)
        for name in (f"bake-{kind}.log", "dump.log"):
            (tmp / name).unlink(missing_ok=True)
        final = snapshot_dir / kind
        checkpoint.replace_dir(tmp, final)
        log.info("%s snapshot: restore checked in %.2f s; written to %s", kind, image.verify_restore_s, final)
        return image
    finally:
        if tmp.exists():
            import shutil

            shutil.rmtree(tmp, ignore_errors=True)


def verify_restores(criu: Criu, directory: Path, image: SnapshotImage, hooks: CriuHooks) -> float:
    """Restore the image once; it must take over a handoff and exit 0. Returns the restore's seconds."""
    message = handoff.Handoff(environ=dict(os.environ), cwd=os.getcwd(), spawn_time=time.time(),
                              restore_started=time.time(), restore_path=image.kind, verify=True)
    pid, restore_s = thaw(criu, directory, image, message, hooks).wait()
    _, status = os.waitpid(pid, 0)
    if os.waitstatus_to_exitcode(status) != 0:
        raise SnapshotError(f"the restored {image.kind} snapshot exited with {os.waitstatus_to_exitcode(status)}")
    return restore_s


def thaw(criu: Criu, directory: Path, image: SnapshotImage, message: handoff.Handoff,
         hooks: CriuHooks, verification: Verification | None = None,
         running: RestoreRun | None = None, feature_cache: bool = True) -> RestoreRun:
    """Restore and hand over; returns the restore, done (`wait()`: the running process's pid, our child, and
    the restore's seconds; `lazy_pages`: the daemon still filling its memory in, if LAZY_PAGES).
    VERIFICATION (the image files' digests, being checked since before the restore) must pass before the
    restored process gets its instance. RUNNING: this snapshot's restore, started early by the entry point
    (snapshots/early_restore.py), else it starts here, offered the image's record of the kernel's features
    unless FEATURE_CACHE is False. Raises SnapshotError, HandoffError or DigestMismatch
    with nothing left running."""
    helper = None
    try:
        if hooks.start_restore_helper is not None:
            helper = hooks.start_restore_helper(image, not message.verify)
    except BaseException:
        if running is not None:
            running.undo()
        raise
    handed_over = False
    try:
        if running is None:
            message.restore_detail["before_criu_s"] = round(time.time() - message.restore_started, 4)
            running = checkpoint.start_restore(criu, directory, image.snapshot_id, hooks.criu_options,
                                               image.kernel_features if feature_cache else None)
        else:  # CRIU has been restoring since the entry point; the bootstrap's imports and checks overlapped it
            message.restore_detail["early_s"] = round(time.time() - running.started, 4)
        try:
            pid, restore_s = checkpoint.finish_restore(running)
        except SnapshotError as error:
            if verification is not None:  # a damaged image is the reason CRIU failed, if it is damaged
                verification.wait()
            if handoff.name_taken(image.snapshot_id):
                raise SnapshotError("another process restored from this snapshot waits for its handoff in this "
                                    f"network namespace (docs/snapshots.md); {error}") from error
            raise
        log.info("%s snapshot: CRIU restored pid %d in %.3f s", image.kind, pid, restore_s)
        message.restore_detail["criu_s"] = round(restore_s, 4)
        message.restore_detail["kernel_features"] = "record" if running.features_offered else "probed"
        if running.lazy_pages is not None:
            message.restore_detail["lazy_pages"] = True
        elif running.lazy_refused is not None:
            log.warning("%s snapshot: restored without lazy pages: %s", image.kind, running.lazy_refused)
            message.restore_detail["lazy_pages"] = False

        def after_restore(pid: int) -> None:
            cuda_s = helper.restore(pid)
            message.restore_detail["cuda_s"] = round(cuda_s, 4)
            log.info("%s snapshot: CUDA state of pid %d restored in %.3f s", image.kind, pid, cuda_s)

        channel = helper.channel if helper is not None else None
        message.weights_channel = channel is not None
        def verified() -> None:
            verification.wait()
            message.verify_span = verification.span()

        checkpoint.hand_over(pid, image.snapshot_id, message, HANDOFF_TIMEOUT_S,
                             after_restore if helper is not None and helper.restores_cuda else None, channel,
                             verified if verification is not None else None)
        handed_over = True
    except BaseException:
        if running is not None:
            running.stop_lazy_pages()  # the restored tree is gone already (undone by CRIU or killed)
        raise
    finally:
        if running is not None:
            running.release_claim()  # handed over, or nothing restored is left
        if helper is not None:
            helper.detach() if handed_over else helper.close()
    return running


def boot_handoff(kind: str, argv: list[str], skipped: dict[str, str],
                 running: RestoreRun | None = None) -> handoff.Handoff:
    """The message for a restore at boot: this process's instance. RUNNING: the restore started early, whose
    start is the restore's."""
    spawned = os.environ.get("THAWLLM_SPAWN_TIME")
    return handoff.Handoff(environ=dict(os.environ), cwd=os.getcwd(),
                           spawn_time=float(spawned) if spawned else process_start_time(),
                           restore_started=running.started if running is not None else time.time(),
                           restore_path=kind, argv=list(argv), skipped=dict(skipped))
