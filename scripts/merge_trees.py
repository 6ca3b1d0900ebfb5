"""One JSON of a `scripts/coldstart_trees.sh` run: each start's spawn to first token, its stages' seconds and its
CUDA context's time, by arm and round, and each arm's medians, read from the run's `$RESULTS/NAME-ROUND/
coldstart.json` files. Prints the medians.

    python scripts/merge_trees.py results --arm late=1b14048 --arm early=4f1a2b3 \\
        --what "Qwen2-1.5B process restores 4 s after the GPU's last CUDA client" --out trees.json
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path


def start_record(run: dict) -> dict:
    """What one start of `faas-bench coldstart` measured, flat: the figures compared across arms."""
    record = {"spawn_to_first_token_s": run["spawn_to_first_token_s"], "spawn_to_ready_s": run["spawn_to_ready_s"]}
    for stage in run["stages"]:
        record.setdefault(f"{stage['stage']}_s", stage["seconds"])
        if stage["stage"] == "cuda_init":
            record["cuda_init_start_s"] = stage["start_s"]
            record["context_s"] = stage["detail"].get("context_s")
    if run.get("reference_read_s"):
        record["over_reference_read"] = round(run["spawn_to_first_token_s"] / run["reference_read_s"], 4)
    return record


def merge(results: Path, arms: dict[str, str]) -> dict:
    runs: dict[str, list[dict]] = {name: [] for name in arms}
    machine = None
    for name in arms:
        rounds = sorted(results.glob(f"{name}-*/coldstart.json"), key=lambda p: int(p.parent.name.rsplit("-", 1)[1]))
        if not rounds:
            raise SystemExit(f"merge_trees: no {name}-ROUND/coldstart.json under {results}")
        for path in rounds:
            coldstart = json.loads(path.read_text())
            machine = machine or coldstart["machine"]
            for run in coldstart["modes"]["process"]["runs"]:
                runs[name].append({"round": int(path.parent.name.rsplit("-", 1)[1]), **start_record(run)})
    return {"machine": machine, "arms": {name: {"tree": tree, "median": medians(runs[name]), "runs": runs[name]}
                                         for name, tree in arms.items()}}


def medians(runs: list[dict]) -> dict[str, float]:
    """Each figure's median over RUNS: the figures every run has, the round aside."""
    return {key: round(statistics.median(r[key] for r in runs), 4)
            for key in runs[0] if key != "round" and all(r.get(key) is not None for r in runs)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("results", type=Path, help="coldstart_trees.sh's $RESULTS")
    parser.add_argument("--arm", action="append", required=True, metavar="NAME=TREE",
                        help="an arm as coldstart_trees.sh ran it, and the commit its tree is")
    parser.add_argument("--what", required=True, help="what the run compares, for the reader of the JSON")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    arms = dict(arm.split("=", 1) for arm in args.arm)
    merged = {"what": args.what, **merge(args.results, arms)}
    args.out.write_text(json.dumps(merged, indent=1))
    for name, arm in merged["arms"].items():
        median = arm["median"]
        print(f"{name:<12} " + "  ".join(f"{key} {median[key]:g}" for key in
                                         ("spawn_to_first_token_s", "cuda_init_start_s", "context_s") if key in median))


if __name__ == "__main__":
    main()
