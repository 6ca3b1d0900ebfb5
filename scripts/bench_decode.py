"""Decode throughput on the GPU: the engine with and without CUDA graphs, beside transformers' generate.

The engine runs with async scheduling (each step launched before the last one's tokens are read), and its
CUDA-graph rate is also measured one step at a time (ASYNC_SCHEDULING=0), in the same run.

For each model shape (random bf16 weights of the real shape; the same weights in both), for each batch
size: steady-state decode tokens/s, and for batch 1 the step time against the HBM roofline (weight bytes /
3.35 TB/s on an H100 SXM) and beside the GPU time of one replay of the batch-1 graph: the difference is what
the host adds to each step (scheduling, staging inputs, sampling, the GPU idle in between). Batch 1 is also
measured with every projection through cuBLAS instead of the one-token GEMV kernel (graph recaptured, same
engine, same run). Prints the tables and writes JSON.

    python scripts/bench_decode.py --shapes qwen2-1.5b llama-3-8b --batch 1 8 32 64 --out decode.json
"""

from __future__ import annotations

import argparse
import dataclasses
import asyncio
import json
import statistics
import sys
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from runtime.engine import Engine, EngineConfig, SamplingParams  # noqa: E402
from runtime.engine.weight_plan import tensor_views  # noqa: E402
from runtime.weights.hf_dir import CopiedLoad  # noqa: E402
from scripts.model_shapes import SHAPES, write_config_and_tokenizer  # noqa: E402

HBM_BYTES_PER_S = 3.35e12
PROMPT_LEN = 128


def copy_from(state: dict[str, torch.Tensor]):
    def load(plan, buffer):
        views = tensor_views(buffer, plan)
        for t in plan.tensors:
            for s in t.sources:
                views[t.name][s.row:s.row + s.rows].copy_(state[s.name])
        return CopiedLoad()
    return load


def engine_decode_rate(engine: Engine, batch: int, steps: int) -> float:
    prompts = [torch.randint(100, 1000, (PROMPT_LEN,)).tolist() for _ in range(batch)]

    async def one(prompt, stamps):
        async for _ in engine.generate(prompt, SamplingParams(max_tokens=steps, temperature=0, ignore_eos=True)):
            stamps.append(time.perf_counter())

    async def run():
        stamps = [[] for _ in range(batch)]
        await asyncio.gather(*[one(p, s) for p, s in zip(prompts, stamps)])
        return stamps

    stamps = asyncio.run(run())[0]
    step = statistics.median(b - a for a, b in zip(stamps[4:], stamps[5:]))
    return batch / step


def graph_replay_ms(engine: Engine, replays: int = 100) -> float:
    """GPU time of one replay of the batch-1 decode graph: back-to-back replays between two CUDA events, so the
    host is always ahead and the GPU never waits for it (the inputs are whatever the last step left)."""
    graph = engine.runner.graphs[1]
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(replays):
        graph.replay()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / replays


@contextmanager
def cublas_projections():
    """Every projection through cuBLAS, as before the one-token GEMV kernel: the same engine, in the same run."""
    from runtime.engine.kernels import gemv

    fits, gemv.fits = gemv.fits, lambda *args, **kwargs: False
    try:
        yield
    finally:
        gemv.fits = fits


def hf_decode_rate(model, batch: int, steps: int) -> float:
    ids = torch.randint(100, 1000, (batch, PROMPT_LEN), device="cuda")
    kwargs = dict(do_sample=False, pad_token_id=0)

    def timed(n):
        torch.cuda.synchronize()
        t = time.perf_counter()
        model.generate(ids, max_new_tokens=n, min_new_tokens=n, **kwargs)
        torch.cuda.synchronize()
        return time.perf_counter() - t

    timed(2)
    return batch * (steps - 1) / (timed(steps) - timed(1))


def random_hf_model(name: str, model_dir: Path):
    """SHAPE's config and tokenizer written to MODEL_DIR, and a transformers model of it on the GPU with seeded
    random bf16 weights (what the engine copies its weights from)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    write_config_and_tokenizer(model_dir, SHAPES[name], dtype="bfloat16")
    torch.manual_seed(0)
    with torch.device("cuda"):
        return AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model_dir), dtype=torch.bfloat16).eval()


def started_engine(model_dir: Path, hf, **config) -> Engine:
    """An engine on cuda, bf16, with the weights of HF (a `random_hf_model`), started: graphs captured."""
    engine = Engine.build(model_dir, copy_from(hf.state_dict()),
                          EngineConfig(device="cuda", dtype="bfloat16", **config))
    engine.start()
    return engine


def bench_shape(name: str, batches: list[int], steps: int) -> list[dict]:
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = Path(tmp)
        hf = random_hf_model(name, model_dir)
        hf_rates = {b: hf_decode_rate(hf, b, steps) for b in batches}
        engine = started_engine(model_dir, hf, max_model_len=2048, max_num_seqs=256, gpu_memory_utilization=0.6)
        del hf
        torch.cuda.empty_cache()
        weight_bytes = engine.plan.total_bytes
        graphs = {b: engine_decode_rate(engine, b, steps) for b in batches}
        engine.config = dataclasses.replace(engine.config, async_scheduling=False)  # read by every step
        graphs_sync = {b: engine_decode_rate(engine, b, steps) for b in batches}
        engine.config = dataclasses.replace(engine.config, async_scheduling=True)
        replay_ms = graph_replay_ms(engine) if 1 in batches else None
        runner = engine.runner
        cublas = {}
        if 1 in batches:
            with cublas_projections():
                runner.capture_graphs(sizes=[1])
                cublas = {"graphs_tok_s": engine_decode_rate(engine, 1, steps), "replay_ms": graph_replay_ms(engine)}
            runner.capture_graphs(sizes=[1])
        sizes, runner.graph_batch_sizes = runner.graph_batch_sizes, []
        eager = {b: engine_decode_rate(engine, b, steps) for b in batches}
        if 1 in batches:
            with cublas_projections():
                cublas["eager_tok_s"] = engine_decode_rate(engine, 1, steps)
        runner.graph_batch_sizes = sizes
        engine.shutdown()
        for b in batches:
            row = {"shape": name, "batch": b, "graphs_tok_s": graphs[b], "graphs_sync_tok_s": graphs_sync[b],
                   "eager_tok_s": eager[b],
                   "transformers_tok_s": hf_rates[b], "graphs_vs_eager": graphs[b] / eager[b],
                   "graphs_vs_transformers": graphs[b] / hf_rates[b]}
            if b == 1:
                roofline_s = weight_bytes / HBM_BYTES_PER_S
                row["step_ms"] = 1e3 / graphs[b]
                row["sync_step_ms"] = 1e3 / graphs_sync[b]
                row["replay_ms"] = replay_ms
                row["host_ms"] = row["step_ms"] - replay_ms
                row["roofline_ms"] = roofline_s * 1e3
                row["roofline_fraction"] = roofline_s * graphs[b]
                row["cublas_at_batch_1"] = {**cublas, "graphs_vs_eager": cublas["graphs_tok_s"] / cublas["eager_tok_s"],
                                            "roofline_fraction": roofline_s * cublas["graphs_tok_s"]}
            rows.append(row)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", nargs="+", default=["qwen2-1.5b", "llama-3-8b"])
    parser.add_argument("--batch", nargs="+", type=int, default=[1, 8, 32, 64])
    parser.add_argument("--steps", type=int, default=64)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    rows = [r for shape in args.shapes for r in bench_shape(shape, args.batch, args.steps)]
    print(f"\n{'shape':<12} {'batch':>5} {'graphs tok/s':>13} {'sync tok/s':>11} {'eager tok/s':>12} "
          f"{'hf tok/s':>10} {'g/eager':>8} {'g/hf':>6} {'step ms':>8} {'sync ms':>8} {'replay ms':>9} "
          f"{'host ms':>8} {'roofline':>9}")
    for r in rows:
        extra = (f"{r['step_ms']:8.2f} {r['sync_step_ms']:8.2f} {r['replay_ms']:9.2f} {r['host_ms']:8.2f} "
                 f"{r['roofline_fraction']:8.0%}" if "step_ms" in r else "")
        print(f"{r['shape']:<12} {r['batch']:>5} {r['graphs_tok_s']:>13.0f} {r['graphs_sync_tok_s']:>11.0f} "
              f"{r['eager_tok_s']:>12.0f} {r['transformers_tok_s']:>10.0f} {r['graphs_vs_eager']:>8.2f} "
              f"{r['graphs_vs_transformers']:>6.2f} {extra}")
    if args.out:
        from runtime.bench.machine import describe_machine

        args.out.write_text(json.dumps({"command": sys.argv, "machine": describe_machine(), "rows": rows}, indent=2))
    print("\nbatch 1 with every projection through cuBLAS (no GEMV kernel), same engine, same run:")
    for r in rows:
        if "cublas_at_batch_1" in r:
            c = r["cublas_at_batch_1"]
            print(f"{r['shape']:<12} graphs {c['graphs_tok_s']:.0f} tok/s, eager {c['eager_tok_s']:.0f} tok/s, "
                  f"g/eager {c['graphs_vs_eager']:.2f}, replay {c['replay_ms']:.2f} ms, "
                  f"roofline {c['roofline_fraction']:.0%}")


if __name__ == "__main__":
    main()
