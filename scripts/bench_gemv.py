"""The decode projections of one to eight tokens: the engine's Triton kernels (runtime/engine/kernels/gemv.py)
against cuBLAS (torch.nn.functional.linear), per projection of a model shape, on the GPU.

Each product is timed in a CUDA graph of back-to-back launches over enough copies of the weight matrix that
no launch finds its weights in L2, as a decode step does. Reported: microseconds per product and the HBM
bandwidth it reads the weights at (weight bytes / time). Prints a table and writes JSON.

    python scripts/bench_gemv.py --shapes qwen2-1.5b llama-3-8b --tokens 1 2 4 8 --out gemv.json

`--sweep` times the one-token kernel instead at other compile-time configurations (rows per program, K
chunk, warps, pipeline stages) and sums each configuration's time over a whole decode step's projections
(every layer's and the lm_head) per shape: the kernel has one configuration for every shape, so the one to
keep is the fastest over all shapes.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from scripts.model_shapes import SHAPES  # noqa: E402

L2_BYTES = 50 * 2**20  # the H100's L2; the weight copies a graph cycles through exceed it several times


def projections(shape: dict) -> dict[str, tuple[int, int]]:
    """name -> (N, K) of one layer's fused projections and the lm_head."""
    hidden, heads, kv = shape["hidden_size"], shape["num_attention_heads"], shape["num_key_value_heads"]
    head_dim = hidden // heads
    return {"qkv": ((heads + 2 * kv) * head_dim, hidden), "o": (hidden, hidden),
            "gate_up": (2 * shape["intermediate_size"], hidden), "down": (hidden, shape["intermediate_size"]),
            "lm_head": (shape["vocab_size"], hidden)}


def time_product(fn, weights, x, replays: int) -> float:
    """Seconds per product: a CUDA graph of one launch per weight copy, replayed REPLAYS times."""
    import torch

    outs = [fn(x, w) for w in weights]  # compile and warm up outside the graph
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = [fn(x, w) for w in weights]
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(replays):
        graph.replay()
    end.record()
    end.synchronize()
    del outs
    return start.elapsed_time(end) / 1e3 / replays / len(weights)


def measure(shape_name: str, tokens: list[int], replays: int) -> list[dict]:
    import torch
    import torch.nn.functional as F

    from runtime.engine.kernels.gemv import fits, gemv

    rows = []
    for name, (n, k) in projections(SHAPES[shape_name]).items():
        nbytes = n * k * 2
        copies = max(2, -(-4 * L2_BYTES // nbytes))
        weights = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02 for _ in range(copies)]
        for m in tokens:
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            if not fits(x, weights[0], None, None):
                continue
            triton_s = time_product(lambda a, w: gemv(a, w), weights, x, replays)
            cublas_s = time_product(lambda a, w: F.linear(a, w), weights, x, replays)
            rows.append({"shape": shape_name, "projection": name, "tokens": m, "n": n, "k": k,
                         "triton_us": round(triton_s * 1e6, 2), "cublas_us": round(cublas_s * 1e6, 2),
                         "triton_tb_s": round(nbytes / triton_s / 1e12, 3),
                         "cublas_tb_s": round(nbytes / cublas_s / 1e12, 3)})
        del weights
        torch.cuda.empty_cache()
    return rows


SWEEP = [(bn, bk, warps, stages) for bn in (4, 8, 16) for bk in (512, 1024, 2048) for warps in (4, 8)
         for stages in (2, 3, 4)]


def sweep(shape_names: list[str], replays: int) -> list[dict]:
    """Per configuration and shape: microseconds of one decode step's one-token projections."""
    import torch
    import triton

    from runtime.engine.kernels.dependent_launch import launch_options
    from runtime.engine.kernels.gemv import _gemv_kernel

    rows = []
    for shape_name in shape_names:
        shape = SHAPES[shape_name]
        for name, (n, k) in projections(shape).items():
            count = 1 if name == "lm_head" else shape["num_hidden_layers"]
            copies = max(2, -(-4 * L2_BYTES // (n * k * 2)))
            weights = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02 for _ in range(copies)]
            x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
            for bn, bk, warps, stages in SWEEP:
                def launch(a, w, bn=bn, bk=bk, warps=warps, stages=stages):
                    out = torch.empty((1, w.shape[0]), dtype=a.dtype, device=a.device)
                    _gemv_kernel[(triton.cdiv(w.shape[0], bn),)](w, a, w, out, w.shape[0], w.shape[1], 0, BLOCK_N=bn,
                                                                  BLOCK_K=bk, num_warps=warps, num_stages=stages,
                                                                  **launch_options(a.device))
                    return out
                seconds = time_product(launch, weights, x, replays)
                rows.append({"shape": shape_name, "projection": name, "config": [bn, bk, warps, stages],
                             "us": round(seconds * 1e6, 2), "step_us": round(seconds * 1e6 * count, 1),
                             "tb_s": round(n * k * 2 / seconds / 1e12, 3)})
            del weights
            torch.cuda.empty_cache()
    return rows


def sweep_table(rows: list[dict]) -> str:
    """Configurations by their decode step's projection time, summed over the shapes, fastest first."""
    totals: dict[tuple, dict[str, float]] = {}
    for r in rows:
        per_shape = totals.setdefault(tuple(r["config"]), {})
        per_shape[r["shape"]] = per_shape.get(r["shape"], 0.0) + r["step_us"]
    shapes = sorted({r["shape"] for r in rows})
    out = ["| BLOCK_N, BLOCK_K, warps, stages | " + " | ".join(f"{s} step us" for s in shapes) + " |",
           "|" + " --- |" * (len(shapes) + 1)]
    for config, per_shape in sorted(totals.items(), key=lambda item: sum(item[1].values())):
        out.append(f"| {', '.join(map(str, config))} | " + " | ".join(f"{per_shape[s]:.0f}" for s in shapes) + " |")
    return "\n".join(out)


def table(rows: list[dict]) -> str:
    out = ["| shape | projection | tokens | N x K | Triton us | cuBLAS us | Triton TB/s | cuBLAS TB/s |",
           "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    out += [f"| {r['shape']} | {r['projection']} | {r['tokens']} | {r['n']} x {r['k']} | {r['triton_us']} | "
            f"{r['cublas_us']} | {r['triton_tb_s']} | {r['cublas_tb_s']} |" for r in rows]
    return "\n".join(out)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", nargs="+", default=["qwen2-1.5b", "llama-3-8b"], choices=sorted(SHAPES))
    p.add_argument("--tokens", nargs="+", type=int, default=[1, 2, 4, 8], help="tokens per product (1 to 8)")
    p.add_argument("--replays", type=int, default=50, help="graph replays timed per product")
    p.add_argument("--sweep", action="store_true", help="the one-token kernel at other configurations")
    p.add_argument("--out", type=Path, help="write the rows as JSON here")
    args = p.parse_args()
    import torch

    if not torch.cuda.is_available():
        print("bench_gemv: needs a CUDA GPU", file=sys.stderr)
        return 2
    if args.sweep:
        rows = sweep(args.shapes, args.replays)
        print(sweep_table(rows))
    else:
        rows = [r for shape in args.shapes for r in measure(shape, args.tokens, args.replays)]
        print(table(rows))
    if args.out:
        from runtime.bench.machine import describe_machine

        args.out.write_text(json.dumps({"command": sys.argv, "machine": describe_machine(), "rows": rows},
                                       indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
