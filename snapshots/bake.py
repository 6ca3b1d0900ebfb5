"""The snapshot half of faas-build: bake, for one model and one set of settings, the snapshot of every
restore path this machine can produce (docs/architecture.md, "Restore paths").

Order matters: materialized first, because the process path restores the materialized state after its
CRIU restore, then process, then gpu (the slowest to bake). A kind that cannot be baked here is skipped
with its reason when it was not asked for by name; a kind that fails, or was asked for and cannot be baked,
is a failure. Each bake writes to a temporary name and renames, so a failure leaves nothing half-written.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable

from runtime.config import Settings
from runtime.logs import get_logger
from snapshots.fingerprint import resolved_device

log = get_logger("snapshots.bake")

#: bake order (not restore order: see the module docstring)
KINDS = ("materialized", "process", "gpu")
#: a several-model instance: each model's own, in SNAPSHOT_DIR/name (its KV profile and graphs, which the pool
#: hands to the model's first start), and the instance's, in SNAPSHOT_DIR (one process holding every engine)
PER_MODEL_KINDS = ("materialized",)
INSTANCE_KINDS = ("process", "gpu")


class CannotBake(Exception):
    """This machine cannot produce that kind of snapshot (no GPU, no criu...): skipped, with the reason."""


@dataclass(frozen=True)
class BakeResult:
    kind: str
    status: str  # "baked", "skipped" or "failed"
    detail: str
    seconds: float


def bake_snapshots(settings: Settings, model_dir: Path | None, kinds: Iterable[str] | None = None,
                   scope: Iterable[str] = KINDS) -> list[BakeResult]:
    """Bake into settings.snapshot_dir the kinds of SCOPE (several models: PER_MODEL_KINDS for each model,
    whose materialised graphs are then captured against its KV cache in a pool; INSTANCE_KINDS for the
    instance, MODEL_DIR None) that KINDS names; KINDS None means every kind this machine can bake."""
    scope = tuple(scope)
    pooled = scope == PER_MODEL_KINDS
    wanted = [kind for kind in KINDS if kind in scope and (kinds is None or kind in kinds)]
    results = []
    for kind in wanted:
        started = time.time()
        try:
            detail = (bake_materialized_state(settings, model_dir, pooled) if kind == "materialized"
                      else BAKERS[kind](settings, model_dir))
            status = "baked"
        except CannotBake as why:
            status, detail = ("skipped" if kinds is None else "failed"), str(why)
        except Exception as exc:  # one kind failing must not keep the others from being baked
            log.exception("%s snapshot failed", kind)
            status, detail = "failed", f"{type(exc).__name__}: {exc}"
        result = BakeResult(kind, status, detail, time.time() - started)
        log.info("%s snapshot %s in %.1f s: %s", kind, status, result.seconds, detail)
        results.append(result)
    return results


def bake_materialized_state(settings: Settings, model_dir: Path, pooled: bool = False) -> str:
    if resolved_device(settings) != "cuda":
        raise CannotBake("needs a GPU (the KV profile and the decode graphs are the GPU's)")
    if settings.enforce_eager:
        raise CannotBake("ENFORCE_EAGER is set: there are no graphs to materialise")
    from runtime.launch import engine_config
    from snapshots.fingerprint import current_fingerprint
    from snapshots.materialized import bake_materialized_apart

    report = bake_materialized_apart(model_dir, engine_config(settings, "cuda"), settings.snapshot_dir,
                               current_fingerprint(settings).as_dict(), pooled)
    if not report.validated:
        first = next(iter(report.problems.items()), (None, ["unknown"]))
        raise RuntimeError(f"{len(report.problems)} graphs failed validation, e.g. batch size {first[0]}: "
                           f"{first[1][0]}")
    where = " (the KV cache's address range in a pool)" if pooled else ""
    return f"{report.graphs} graphs validated bit for bit in a new process, {report.kv_blocks} KV blocks{where}"


def bake_process(settings: Settings, model_dir: Path | None) -> str:
    from snapshots.process import bake_process_snapshot

    _require_criu()
    image = bake_process_snapshot(settings, model_dir, settings.snapshot_dir)
    engines = f" of the engines of {image.fingerprint.placements}" if image.model_dirs else ""
    return f"CRIU image of {image.size_bytes / 2**20:.0f} MiB{engines}"


def bake_gpu(settings: Settings, model_dir: Path | None) -> str:
    if model_dir is None:
        from snapshots.image import SEVERAL_MODELS_NO_GPU

        raise CannotBake(SEVERAL_MODELS_NO_GPU)
    if resolved_device(settings) != "cuda":
        raise CannotBake("needs a GPU")
    from runtime.cuda_driver import bindings_installed

    if not bindings_installed():
        raise CannotBake("cuda-bindings is not installed (the CUDA checkpoint API)")
    _require_criu()
    from snapshots.gpu import bake_gpu_snapshot

    image = bake_gpu_snapshot(settings, model_dir, settings.snapshot_dir)
    return f"CRIU image of {image.size_bytes / 2**20:.0f} MiB, GPU memory included"


def _require_criu() -> None:
    from snapshots.criu import find_criu, restore_blockers

    blockers = restore_blockers(find_criu())
    if blockers:
        raise CannotBake("; ".join(blockers))


BAKERS: dict[str, Callable[[Settings, Path | None], str]] = {
    "materialized": bake_materialized_state, "process": bake_process, "gpu": bake_gpu}
