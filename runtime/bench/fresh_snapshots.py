"""The snapshots of `faas-bench switch`'s fresh instance of B, baked for B's existing layout (`python -m
runtime.bench.fresh_snapshots LAYOUT SNAPSHOT_DIR KINDS`, in a child process with the instance's settings as
its environment): what faas-build bakes, without writing the layout a second time (an 8B layout is 15 GiB)."""

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


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:]))
