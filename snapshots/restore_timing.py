"""The last step of faas-build: start the function from each snapshot it baked, for real, and record which
restore path is fastest here, so that RESTORE=auto takes that one first (runtime/start_paths.py).

Each round starts every baked path once, in turns, so that drift (page cache, clocks, other load) falls on
every path alike: a fresh `faas-bootstrap` with RESTORE=<path>, timed by faas-bench's own code from the
spawn to the first streamed token of a short request. The medians go to `restore-order.json` in the
snapshot folder, written to a temporary name and renamed.
"""

from __future__ import annotations

import asyncio
import json
import statistics
import tempfile
import time
from pathlib import Path

from runtime.logs import get_logger
from runtime.start_paths import FIXED_ORDER, ORDER_FILE, RestoreOrder, read_restore_order
from runtime.weights.temps import write_atomically

log = get_logger("snapshots.timing")

#: what is timed: spawn to the first token of a short streamed request, as `faas-bench coldstart` measures
METRIC = "spawn_to_first_token_s"
PROMPT_TOKENS = 32


def time_restore_paths(model_dir: Path, snapshot_dir: Path, paths: list[str], rounds: int,
                       settings_env: dict[str, str] | None = None) -> tuple[RestoreOrder, dict[str, str]]:
    """Start the function from each of PATHS ROUNDS times, in turns; write the medians to ORDER_FILE.
    Returns the order now in force and, per path that could not be timed, why (it is left out of the file).
    With no path timed, the file is removed: auto keeps the fixed order."""
    from runtime.bench.coldstart import ColdStartPlan, run_coldstart

    paths = [p for p in FIXED_ORDER if p in paths]
    env = {"MODEL": str(model_dir), "SNAPSHOT_DIR": str(snapshot_dir), **(settings_env or {})}
    with tempfile.TemporaryDirectory(prefix="restore-timing-") as logs:
        plan = ColdStartPlan(model=str(model_dir), modes=tuple(paths), repeat=rounds, page_cache="warm",
                             settings=env, log_dir=Path(logs), prompt_tokens=PROMPT_TOKENS, max_tokens=2,
                             timeout_s=900.0)
        results = asyncio.run(run_coldstart(plan))
    timed, untimed = {}, {}
    for result in results:
        runs = [getattr(run, METRIC) for run in result.runs]
        if result.status == "ok" and runs:
            timed[result.mode] = {"median_s": round(statistics.median(runs), 4), "runs_s": runs}
        else:
            untimed[result.mode] = result.reason or result.status
    write_order(snapshot_dir, timed, rounds)
    return read_restore_order(snapshot_dir), untimed


def write_order(snapshot_dir: Path, timed: dict[str, dict], rounds: int) -> None:
    target = Path(snapshot_dir) / ORDER_FILE
    if not timed:
        target.unlink(missing_ok=True)
        return
    record = {"metric": METRIC, "rounds": rounds, "measured_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
              "order": sorted(timed, key=lambda p: timed[p]["median_s"]), "paths": timed}
    write_atomically(target, json.dumps(record, indent=1).encode())
