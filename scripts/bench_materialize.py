"""The loading phase with live KV profiling and graph capture versus materialised state (Medusa).

For each model shape: bake the materialised state once, then start the engine in fresh processes, cold (load
the weights, profiling forward, capture 35 graphs), materialised (recorded KV size, all 35 graphs rebuilt from
their description before the weights stream in) and deferred (materialised, but only the graphs up to batch 8
before ready, the default of a function; the other 31 are rebuilt right after, and `all_graphs_s` is engine
start to the last of them), N times each, interleaved. The weights come from a faas-build layout (built once
from the random model) through the pipelined loader. Prints the median of each stage and of the whole loading
phase (engine start: CUDA init to ready), and writes JSON.

    python scripts/bench_materialize.py --shapes qwen2-1.5b llama-3-8b --repeat 3 --work /tmp/bench
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from runtime.engine import EngineConfig  # noqa: E402

CONFIG = dict(device="cuda", dtype="bfloat16", max_model_len=4096, max_num_seqs=256, gpu_memory_utilization=0.9)
STAGES = ("cuda_init", "weights", "kv_cache", "cuda_graphs")
MODES = ("cold", "materialized", "deferred")
DEFERRED_UP_TO = 8  # GRAPHS_BEFORE_READY's default


def child(mode: str, model_dir: Path, snapshot: Path) -> dict:
    from runtime.launch import build_engine
    from snapshots.cudagraph.restore import MaterializedGraphs
    from snapshots.materialized import load_kv_blocks

    engine = build_engine(model_dir, EngineConfig(**CONFIG))
    t0 = time.perf_counter()
    if mode == "cold":
        engine.start()
    else:
        restorer = MaterializedGraphs(snapshot, DEFERRED_UP_TO if mode == "deferred" else None)
        engine.start(kv_blocks=load_kv_blocks(snapshot), graph_restorer=restorer)
    loading = time.perf_counter() - t0
    engine.wait_for_graphs()
    all_graphs = time.perf_counter() - t0
    stages = engine.timeline.durations()
    after = engine.timeline.get("graphs_after_ready")
    return {"mode": mode, "loading_s": loading, "all_graphs_s": all_graphs, **{s: stages.get(s, 0.0) for s in STAGES},
            "fallbacks": len(engine.graph_fallbacks), "graph_detail": engine.timeline.get("cuda_graphs").detail,
            "after_ready_detail": after.detail if after else None}


def run_child(mode: str, model_dir: Path, snapshot: Path) -> dict:
    out = subprocess.run([sys.executable, __file__, "--child", mode, "--model", str(model_dir),
                          "--snapshot", str(snapshot)], capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def bench_shape(shape: str, work: Path, repeat: int, modes: list[str]) -> dict:
    from runtime.weights.layout import write_layout
    from scripts.model_shapes import make_random_model_dir
    from snapshots.materialized import bake_materialized

    # the engine loads a faas-build layout through the pipelined loader, as a function does
    model_dir = work / f"{shape}-layout"
    if not (model_dir / "manifest.json").exists():
        write_layout(str(make_random_model_dir(work / shape, shape)), str(model_dir), dtype="bfloat16",
                     progress=False)
    snapshot_dir = work / f"{shape}-snapshot"
    snapshot_dir.mkdir(exist_ok=True)
    t = time.perf_counter()
    report = bake_materialized(model_dir, EngineConfig(**CONFIG), snapshot_dir)
    bake_s = time.perf_counter() - t
    if not report.validated:
        raise SystemExit(f"{shape}: materialisation failed validation: {report.problems}")
    runs = {mode: [] for mode in modes}
    for _ in range(repeat):
        for mode in modes:
            runs[mode].append(run_child(mode, model_dir, snapshot_dir / "materialized"))
    medians = {mode: {k: statistics.median(r[k] for r in rs) for k in ("loading_s", "all_graphs_s") + STAGES}
               for mode, rs in runs.items()}
    live = medians["cold"]["kv_cache"] + medians["cold"]["cuda_graphs"]
    versus_live = {mode: {"kv_graphs_fraction": (medians[mode]["kv_cache"] + medians[mode]["cuda_graphs"]) / live,
                          "loading_reduction": 1 - medians[mode]["loading_s"] / medians["cold"]["loading_s"]}
                   for mode in modes if mode != "cold"}
    return {"shape": shape, "bake_s": bake_s, "graphs": report.graphs, "runs": runs, "median": medians,
            "versus_live": versus_live}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", nargs="+", default=["qwen2-1.5b", "llama-3-8b"])
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES),
                        help="cold (live profiling and capture) is always run: the others are compared with it")
    parser.add_argument("--work", type=Path, default=Path("/tmp/thawllm-bench"))
    parser.add_argument("--out", type=Path)
    parser.add_argument("--child", choices=MODES)
    parser.add_argument("--model", type=Path)
    parser.add_argument("--snapshot", type=Path)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(child(args.child, args.model, args.snapshot)))
        return
    args.work.mkdir(parents=True, exist_ok=True)
    modes = ["cold"] + [m for m in args.modes if m != "cold"]
    results = [bench_shape(shape, args.work, args.repeat, modes) for shape in args.shapes]
    print(f"\n{'shape':<12} {'mode':<13} {'loading s':>9} {'all graphs':>10} " + " ".join(f"{s:>11}" for s in STAGES))
    for r in results:
        for mode, m in r["median"].items():
            print(f"{r['shape']:<12} {mode:<13} {m['loading_s']:>9.3f} {m['all_graphs_s']:>10.3f} "
                  + " ".join(f"{m[s]:>11.3f}" for s in STAGES))
        for mode, v in r["versus_live"].items():
            print(f"{r['shape']:<12} {mode}: KV+graphs restored/live = {v['kv_graphs_fraction']:.1%}; "
                  f"loading phase {v['loading_reduction']:.1%} shorter")
        print(f"{r['shape']:<12} bake {r['bake_s']:.1f} s")
    if args.out:
        from runtime.bench.machine import describe_machine

        args.out.write_text(json.dumps({"command": sys.argv, "machine": describe_machine(), "results": results},
                                       indent=2))


if __name__ == "__main__":
    main()
