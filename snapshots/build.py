"""faas-build: what a function image is built with, one step after another.

    faas-build --model SRC --out DST [--snapshot-dir DIR [--snapshots auto|KIND,...] [--time-restores 3]]
               [--dtype bfloat16] [--file-gb 2] [--chunk-mb 64] [--hash xxh3-128] [--quiet]

The snapshots are baked for the settings the function will boot with: the same environment variables as
faas-bootstrap (DEVICE, MAX_MODEL_LEN, MAX_NUM_SEQS, GPU_MEMORY_UTILIZATION, ...), MODEL being --out. The
function is started once from each CRIU snapshot to list the file pages a start touches (snapshots/start_pages.py),
then from each baked snapshot, in turns (--time-restores rounds), and the measured order is written beside them
for RESTORE=auto (snapshots/restore_timing.py).

Each step takes the build (arguments and what earlier steps produced) and adds to it; a step that cannot be
done raises BuildError (or WeightsError) and the command prints one line, `faas-build: <reason>`, exit 2.
The steps, in order, are `STEPS`; a new step (snapshots) is a function appended there.
"""

from __future__ import annotations

import argparse
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Sequence

from runtime.interrupts import sigterm_interrupts_main
from runtime.logs import get_logger, setup_logging
from runtime.weights.errors import WeightsError
from snapshots.bake import INSTANCE_KINDS, KINDS as SNAPSHOT_KINDS, PER_MODEL_KINDS
from snapshots.restore_run import CRIU_KINDS

log = get_logger("build")

MiB, GiB = 1 << 20, 1 << 30
INTERRUPTED = 130  # the shell's status for a command ended by SIGINT


class BuildError(Exception):
    """Bad input or a step that cannot be done: one line, exit 2."""


class BakeFailed(Exception):
    """A snapshot that should have been baked was not (the others were): exit 1."""


@dataclass
class Build:
    model: str  # the source: Hugging Face directory, .gguf file, or s3:// prefix holding either
    out: str  # the layout: a local directory or an s3:// prefix
    dtype: str
    file_bytes: int
    chunk_bytes: int
    hash: str
    progress: bool
    snapshot_dir: Path | None = None  # where the snapshots go; None: no snapshots
    snapshots: list[str] | None = None  # the kinds asked for by name; None: every kind this machine can bake
    time_restores: int = 3  # rounds of real starts from each baked snapshot, in turns; 0: none (fixed order)
    manifest: object | None = None  # runtime.weights.manifest.Manifest, once the weights step has run


def several_models(build: Build) -> list:
    """The models of a --model list (runtime.config.ModelRef), or [] for a lone model."""
    from runtime.config import model_refs

    try:
        models = model_refs(build.model)
    except ValueError as exc:
        raise BuildError(f"--model={build.model!r}: {exc}") from None
    if len(models) == 1 and models[0].name is None:
        return []
    if any(m.ref is None for m in models):
        raise BuildError("--model: the embedded model is baked into the image already; name a source for each")
    taken = [m.name for m in models if m.name in INSTANCE_KINDS]
    if taken and build.snapshot_dir is not None:
        raise BuildError(f"--model: a model named {taken[0]!r} would share --snapshot-dir/{taken[0]} with the "
                         "instance's snapshot of that kind: name it otherwise")
    return list(models)


def build_weights(build: Build) -> None:
    """The loading-optimised layout of the model's weights at build.out (of each model, at build.out/name)."""
    from runtime.weights.layout import write_layout

    models = several_models(build)
    if models:
        _build_each_layout(build, models)
        return
    build.manifest = write_layout(build.model, build.out, dtype=build.dtype, file_bytes=build.file_bytes,
                                  chunk_bytes=build.chunk_bytes, hash=build.hash, progress=build.progress)
    log.info("layout written to %s: %.2f GiB in %d files, source %s", build.out,
             build.manifest.total_bytes / GiB, len(build.manifest.files), build.manifest.content_hash)


def _build_each_layout(build: Build, models: list) -> None:
    """Every model's layout in a temporary directory beside --out, renamed to --out once all are written."""
    import shutil

    from runtime.weights.layout import write_layout
    from runtime.weights.temps import temp_beside

    if build.out.startswith("s3://"):
        raise BuildError("several models need a local --out (each model's layout goes to --out/name)")
    final = Path(build.out)
    if final.exists():
        raise BuildError(f"--out {build.out!r} exists already")
    temp = temp_beside(final)
    temp.mkdir(parents=True)
    try:
        for model in models:
            manifest = write_layout(model.ref, str(temp / model.name), dtype=build.dtype, file_bytes=build.file_bytes,
                                    chunk_bytes=build.chunk_bytes, hash=build.hash, progress=build.progress)
            log.info("layout of %s written: %.2f GiB in %d files, source %s", model.name,
                     manifest.total_bytes / GiB, len(manifest.files), manifest.content_hash)
        temp.rename(final)
    except BaseException:
        shutil.rmtree(temp, ignore_errors=True)
        raise
    served = ",".join(f"{m.name}={final.resolve() / m.name}" for m in models)
    print(f"boot with MODEL={served}", file=sys.stderr)


def build_snapshots(build: Build) -> None:
    """The restore paths' snapshots (snapshots/bake.py), for a function that boots with MODEL=build.out (with
    several models, for MODEL=name=OUT/name,...: each model's materialized state in --snapshot-dir/name, and
    the instance's process snapshot, every model's engine in one image, in --snapshot-dir)."""
    if build.snapshot_dir is None:
        return
    from runtime.config import ConfigError, ModelRef, Settings

    models = several_models(build)
    try:
        settings = Settings.from_env()
    except ConfigError as exc:
        raise BuildError(str(exc)) from None
    if not models:
        model_dir = Path(build.out).resolve()
        _bake(build, settings.replace(model=str(model_dir), snapshot_dir=build.snapshot_dir.resolve()), model_dir)
        return
    failed = []
    model_dirs = {model.name: (Path(build.out) / model.name).resolve() for model in models}
    for name, model_dir in model_dirs.items():
        per_model = settings.for_model(ModelRef(name, str(model_dir))).replace(
            snapshot_dir=(build.snapshot_dir / name).resolve())
        try:
            _bake(build, per_model, model_dir, f"{name}:", PER_MODEL_KINDS)
        except BakeFailed as exc:
            failed.append(f"{name}: {exc}")
    instance = settings.replace(model=",".join(f"{name}={path}" for name, path in model_dirs.items()),
                                snapshot_dir=build.snapshot_dir.resolve())
    try:
        _bake(build, instance, None, "the instance (every model's engine):", INSTANCE_KINDS)
    except BakeFailed as exc:
        failed.append(f"the instance: {exc}")
    if failed:
        raise BakeFailed("; ".join(failed))


def _bake(build: Build, settings, model_dir: Path | None, heading: str | None = None,
          scope: tuple[str, ...] = SNAPSHOT_KINDS) -> None:
    from snapshots.bake import bake_snapshots

    results = bake_snapshots(settings, model_dir, build.snapshots, scope)
    if not results:  # none of the kinds asked for is of this scope
        return
    if heading:
        print(heading, file=sys.stderr)
    print("snapshots:", file=sys.stderr)
    for r in results:
        print(f"  {r.kind:<13} {r.status:<8} {r.seconds:7.1f} s  {r.detail}", file=sys.stderr)
    baked = [r.kind for r in results if r.status == "baked"]
    if scope == SNAPSHOT_KINDS:  # a lone model: several are left to their faults
        _record_start_pages(settings, model_dir, [kind for kind in baked if kind in CRIU_KINDS])
    if baked and build.time_restores and scope == SNAPSHOT_KINDS:  # a lone model: several are not timed
        _time_restores(build, settings, model_dir, baked)
    failed = [r.kind for r in results if r.status == "failed"]
    if failed:
        raise BakeFailed(f"snapshots not baked: {', '.join(failed)} (see above); the others are in place")


def _record_start_pages(settings, model_dir: Path, kinds: list[str]) -> None:
    """List the file pages a start from each CRIU snapshot touches (snapshots/start_pages.py); a start that
    fails leaves its snapshot without a list, which restores as well, only slower from cold disk."""
    from runtime.bench import BenchError
    from snapshots.start_pages_record import record_start_pages

    for kind in kinds:
        try:
            files = record_start_pages(model_dir, settings.snapshot_dir, kind)
        except (BenchError, OSError) as exc:
            print(f"  {kind} start pages not listed: {exc}", file=sys.stderr)
            continue
        print(f"  {kind} start pages: {sum(f.bytes for f in files) / MiB:.1f} MiB of {len(files)} files",
              file=sys.stderr)


def _time_restores(build: Build, settings, model_dir: Path, baked: list[str]) -> None:
    from snapshots.restore_timing import time_restore_paths

    log.info("timing the restore paths: %d rounds of %s, in turns", build.time_restores, ", ".join(baked))
    order, untimed = time_restore_paths(model_dir, settings.snapshot_dir, baked, build.time_restores)
    print(f"  {order.summary()}", file=sys.stderr)
    for kind, why in untimed.items():
        print(f"  {kind} not timed: {why}", file=sys.stderr)


#: run in order; each one sees what the ones before it produced
STEPS: list[Callable[[Build], None]] = [build_weights, build_snapshots]


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # one line, exit 2, like every other bad input
        raise BuildError(message)


def parse_args(argv: Sequence[str]) -> Build:
    p = _Parser(prog="faas-build", description="Build a function image's model layout (and snapshots).")
    p.add_argument("--model", required=True, help="Hugging Face directory, .gguf file, or s3:// prefix")
    p.add_argument("--out", required=True, help="layout destination: a new local directory or an s3:// prefix")
    p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16", "float32"))
    p.add_argument("--file-gb", type=float, default=2.0, help="split the weights into files of about this size")
    p.add_argument("--chunk-mb", type=float, default=64.0, help="hashed chunk size")
    # runtime/weights/manifest.py: HASHES and DEFAULT_HASH, spelled out so that --help does not import torch
    p.add_argument("--hash", default="xxh3-128", choices=("xxh3-128", "blake3", "sha256"),
                   help="chunk hash: xxh3-128 (a fast checksum) or a cryptographic blake3 / sha256")
    p.add_argument("--quiet", action="store_true", help="no progress bars")
    p.add_argument("--snapshot-dir", type=Path, help="bake the restore paths' snapshots here (SNAPSHOT_DIR at boot)")
    p.add_argument("--time-restores", type=int, default=3, metavar="ROUNDS",
                   help="start the function from each baked snapshot this many times, in turns, and record the "
                        "fastest order for RESTORE=auto (0: none; auto keeps the fixed order)")
    p.add_argument("--snapshots", default="auto",
                   help="auto (every kind this machine can bake) or a comma-separated list of "
                        "materialized, process, gpu (each must then be baked)")
    a = p.parse_args(argv)
    if a.file_gb <= 0 or a.chunk_mb <= 0:
        raise BuildError("--file-gb and --chunk-mb must be positive")
    if a.time_restores < 0:
        raise BuildError("--time-restores must be 0 or more")
    kinds = None if a.snapshots == "auto" else [k.strip() for k in a.snapshots.split(",") if k.strip()]
    unknown = [k for k in kinds or [] if k not in SNAPSHOT_KINDS]
    if unknown or kinds == []:
        raise BuildError(f"--snapshots={a.snapshots!r}: must be auto or some of {', '.join(SNAPSHOT_KINDS)}")
    if a.snapshot_dir is not None and a.out.startswith("s3://"):
        raise BuildError("--snapshot-dir needs a local --out: a snapshot restores from the directory it was baked with")
    return Build(a.model, a.out, a.dtype, int(a.file_gb * GiB), int(a.chunk_mb * MiB), a.hash, not a.quiet,
                 a.snapshot_dir, kinds, a.time_restores)


def main(argv: Sequence[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    setup_logging("info")
    # SIGTERM unwinds like Ctrl-C, through every step's clean-up, so an interrupted build leaves nothing
    with sigterm_interrupts_main():
        try:
            build = parse_args(argv)
            for step in STEPS:
                step(build)
        except (BuildError, WeightsError) as exc:
            print(f"faas-build: {exc}", file=sys.stderr)
            return 2
        except BakeFailed as exc:
            print(f"faas-build: {exc}", file=sys.stderr)
            return 1
        except KeyboardInterrupt:
            print("faas-build: interrupted; nothing was left at --out", file=sys.stderr)
            return INTERRUPTED
    return 0


def run() -> None:
    """The command: exits with main()'s status."""
    status = main()
    if status == INTERRUPTED:
        # os._exit, after the clean-up main() did: CPython exits by SIGINT instead of with this status when
        # the KeyboardInterrupt, although caught, went through code run by PyRun_String (seen in tests).
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(status)
    sys.exit(status)


if __name__ == "__main__":
    run()
