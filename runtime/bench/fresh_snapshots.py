"""The snapshots of `faas-bench switch`'s fresh instance of B, baked for B's existing layout (`python -m
runtime.bench.fresh_snapshots LAYOUT SNAPSHOT_DIR KINDS`, in a child process with the instance's settings as
its environment): what faas-build bakes, without writing the layout a second time (an 8B layout is 15 GiB).
`python -m runtime.bench.fresh_snapshots --pooled SNAPSHOT_DIR NAME,...` bakes, for the several-model
instance of the environment's MODEL=name=layout,..., the named models' pooled materialized profiles in
SNAPSHOT_DIR/name: what `faas-build --model name=...,... --snapshots materialized` bakes for each model."""

from __future__ import annotations

import sys
from pathlib import Path


def main(layout: str, snapshot_dir: str, kinds: str) -> int:
    from runtime.config import Settings
    from runtime.logs import setup_logging
    from snapshots.bake import bake_snapshots

    setup_logging("info")
    layout_dir = Path(layout).resolve()
    settings = Settings.from_env().replace(model=str(layout_dir), snapshot_dir=Path(snapshot_dir).resolve())
    results = bake_snapshots(settings, layout_dir, kinds.split(","))
    for r in results:
        print(f"{r.kind} {r.status} in {r.seconds:.1f} s: {r.detail}", file=sys.stderr)
    return 0 if all(r.status == "baked" for r in results) else 1


def main_pooled(snapshot_dir: str, names: str) -> int:
    from runtime.config import Settings
    from runtime.logs import setup_logging
    from snapshots.bake import PER_MODEL_KINDS, bake_snapshots

    setup_logging("info")
    settings = Settings.from_env()
    wanted = names.split(",")
    baked = True
    for model in settings.models:
        if model.name not in wanted:
            continue
        per_model = settings.for_model(model).replace(snapshot_dir=Path(snapshot_dir).resolve() / model.name)
        for r in bake_snapshots(per_model, Path(model.ref).resolve(), ["materialized"], PER_MODEL_KINDS):
            print(f"{model.name}: {r.kind} {r.status} in {r.seconds:.1f} s: {r.detail}", file=sys.stderr)
            baked = baked and r.status == "baked"
    return 0 if baked else 1


if __name__ == "__main__":
    if sys.argv[1] == "--pooled":
        sys.exit(main_pooled(*sys.argv[2:]))
    sys.exit(main(*sys.argv[1:]))
