"""GPU snapshots: the whole process of a ready engine (weights loaded, KV cache allocated, CUDA graphs
instantiated, not yet listening), GPU memory included (docs/architecture.md, "Snapshots").

Bake: the runtime is frozen as for a process snapshot but after `engine.start()`; a helper process locks
and checkpoints its CUDA state (snapshots/cuda_checkpoint.py), then CRIU dumps it. Boot: CRIU restores it,
the helper restores the CUDA state and unlocks it, and the handoff (shared with process snapshots) gives it
its instance; the engine serves without a device phase.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from runtime.config import Settings
from runtime.cuda_driver import bindings_installed
from runtime.logs import get_logger
from runtime.start_paths import SkipPath
from snapshots.image import SnapshotImage
from snapshots.process import CriuHooks, bake_snapshot
from snapshots.restore_run import kind_options

if TYPE_CHECKING:
    from snapshots.cuda_checkpoint import RestoreHelper

log = get_logger("snapshots.gpu")


def gpu_hooks(weights_during_restore: str = "never", memory_first: bool = True) -> CriuHooks:
    """WEIGHTS_DURING_RESTORE: at boot, let the CUDA restore helper stream a weight-less image's weights
    while CRIU restores (snapshots/weights_during_restore.py), handing its memory over before the stream
    unless MEMORY_FIRST is False (WEIGHTS_MEMORY_FIRST)."""
    if not bindings_installed():
        raise SkipPath("cuda-bindings is not installed (the CUDA checkpoint API)")

    def start_cuda_restore(image: SnapshotImage, boot: bool) -> "RestoreHelper":
        from snapshots.cuda_checkpoint import RestoreHelper

        stream = boot and weights_during_restore != "never" and image.weights_left_out
        return RestoreHelper(Path(image.model_dir) if stream else None, memory_first=memory_first)

    return CriuHooks(before_dump=_checkpoint_cuda, start_restore_helper=start_cuda_restore,
                     criu_options=list(kind_options("gpu")))


def bake_gpu_snapshot(settings: Settings, model_dir: Path, snapshot_dir: Path,
                      pid_namespace: bool | None = None) -> SnapshotImage:
    """Bake `<snapshot_dir>/gpu/` on a GPU of the type the function will run on. SETTINGS are the
    function's as it will boot (MODEL as at boot); MODEL_DIR is what the engine loads from. PID_NAMESPACE:
    as for `bake_process_snapshot` (the default is False here: CUDA does not initialise in a new pid namespace)."""
    try:
        hooks = gpu_hooks()
    except SkipPath as why:
        from snapshots.checkpoint import SnapshotError

        raise SnapshotError(f"cannot bake a gpu snapshot: {why}") from None
    return bake_snapshot("gpu", settings, model_dir, snapshot_dir, hooks, pid_namespace,
                         weights_left_out=settings.gpu_snapshot_weights == "stream")


def _checkpoint_cuda(pid: int) -> None:
    from snapshots.cuda_checkpoint import run_helper

    log.info("gpu snapshot: CUDA checkpoint of pid %d took %.2f s", pid, run_helper("checkpoint", pid))
