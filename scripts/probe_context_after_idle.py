"""Whether a start's CUDA context is slower after the GPU has had no CUDA client for a while, and whether a
process that keeps the driver initialised (it ran `cuInit` and stays; no context, no memory) takes that away.

Each start is `faas-bench coldstart --repeat 1` of one mode (default `process`, page cache warm) on a baked
snapshot, begun --idle-s seconds after the start before it ended; the arms alternate, one start each per round:
`idle` with nothing else on the GPU in between, `held` with a holder process started at the beginning of the
gap and stopped after the start. For each start: spawn to first token, and the `cuda_init` detail of the
runtime's context (its time, the part of its thread's CPU time in the kernel, its waits).

    python scripts/probe_context_after_idle.py --model /models/qwen2-layout --snapshot-dir /snapshots \\
        --rounds 5 --out context-after-idle-h200-qwen2-1.5b.json
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from merge_trees import medians  # scripts/ is this script's folder

REPO = Path(__file__).resolve().parents[1]

HOLDER = r"""
import ctypes, sys
cu = ctypes.CDLL("libcuda.so.1")
assert cu.cuInit(0) == 0
print("held", flush=True)
sys.stdin.read()
"""


def start_once(args: argparse.Namespace, out: Path) -> dict:
    command = [sys.executable, "-m", "runtime.bench.cli", "coldstart", "--model", args.model, "--snapshot-dir",
               args.snapshot_dir, "--device", "cuda", "--page-cache", "warm", "--modes", args.mode,
               "--repeat", "1", "--out", str(out)]
    done = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=600)
    if done.returncode != 0:
        raise SystemExit(f"probe_context_after_idle: faas-bench failed: {done.stderr.strip()[-600:]}")
    run = json.loads((out / "coldstart.json").read_text())["modes"][args.mode]["runs"][0]
    context = next(s for s in run["stages"] if s["stage"] == "cuda_init")["detail"]
    return {"spawn_to_first_token_s": run["spawn_to_first_token_s"], "context_s": context["context_s"],
            "context_system_s": context["context_system_s"], "context_waits": context["context_waits"]}


def held(args: argparse.Namespace, out: Path) -> dict:
    """A start while a holder, started at the beginning of the idle gap, keeps the driver initialised."""
    holder = subprocess.Popen([sys.executable, "-S", "-c", HOLDER], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                              text=True)
    try:
        if holder.stdout.readline().strip() != "held":
            raise SystemExit("probe_context_after_idle: the holder could not initialise the driver")
        time.sleep(args.idle_s)
        return start_once(args, out)
    finally:
        holder.stdin.close()
        holder.wait(timeout=60)


def idle(args: argparse.Namespace, out: Path) -> dict:
    time.sleep(args.idle_s)
    return start_once(args, out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True, help="the baked layout")
    parser.add_argument("--snapshot-dir", required=True)
    parser.add_argument("--mode", default="process")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--idle-s", type=float, default=4.0)
    parser.add_argument("--out", type=Path, default=Path("context-after-idle.json"))
    args = parser.parse_args()
    arms = {"idle": idle, "held": held}
    runs: dict[str, list[dict]] = {name: [] for name in arms}
    with tempfile.TemporaryDirectory(prefix="probe-context-after-idle-") as work:
        for round_ in range(args.rounds):
            for name, arm in arms.items():
                print(f"probe_context_after_idle: round {round_ + 1}/{args.rounds}, {name}", file=sys.stderr,
                      flush=True)
                runs[name].append(arm(args, Path(work) / f"{name}-{round_}"))
    result = {"date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()), "command": sys.argv,
              "idle_s": args.idle_s, "mode": args.mode,
              "arms": {name: {"median": medians(rs), "runs": rs} for name, rs in runs.items()}}
    for name, arm in result["arms"].items():
        print(f"{name:<5} " + "  ".join(f"{k} {v:g}" for k, v in arm["median"].items()))
    args.out.write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
