"""Where a GPU step's time goes, kernel by kernel (torch's profiler, CUPTI): one replay of the batch-1 decode
graph, and one request of a 24-token question after a cached 2,000-token prefix (its time to first token, and
the kernels of its step). Random bf16 weights of a real shape, built on the GPU.

    python scripts/probe_step_kernels.py --shapes qwen2-1.5b llama-3-8b --out step-kernels-h100.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from runtime.engine import Engine, SamplingParams  # noqa: E402
from scripts.bench_decode import graph_replay_ms, random_hf_model, started_engine  # noqa: E402
from scripts.model_shapes import SHAPES  # noqa: E402


def build(name: str, directory: Path) -> Engine:
    hf = random_hf_model(name, directory)
    engine = started_engine(directory, hf, max_model_len=4096, max_num_seqs=64, gpu_memory_utilization=0.5)
    del hf
    torch.cuda.empty_cache()
    return engine


def kernel_times(work, repeats: int) -> list[dict]:
    """Each kernel's GPU time per repeat of WORK, largest first."""
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(repeats):
            work()
        torch.cuda.synchronize()
    rows = [{"kernel": e.key[:100], "calls": e.count / repeats, "us": e.device_time_total / repeats}
            for e in prof.key_averages() if e.device_time_total > 0]
    return sorted(rows, key=lambda r: -r["us"])


def first_token_s(engine: Engine, prompt: list[int]) -> float:
    async def run() -> float:
        started = time.perf_counter()
        async for _ in engine.generate(prompt, SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)):
            return time.perf_counter() - started
        raise RuntimeError("no token")
    return asyncio.run(run())


def probe(name: str) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        engine = build(name, Path(tmp))
        try:
            result = {"shape": name, "weight_bytes": engine.plan.total_bytes,
                      "decode_replay_ms": graph_replay_ms(engine),
                      "decode_kernels": kernel_times(engine.runner.graphs[1].replay, 20)}
            rng = torch.Generator().manual_seed(2)
            vocab = engine.model_config.vocab_size
            system = torch.randint(100, vocab - 100, (2000,), generator=rng).tolist()
            questions = [torch.randint(100, vocab - 100, (24,), generator=rng).tolist() for _ in range(17)]
            first_token_s(engine, system + questions[0])  # caches the prefix
            result["cached_ttft_ms_p50"] = statistics.median(first_token_s(engine, system + q)
                                                             for q in questions[1:]) * 1e3
            result["cached_request_kernels"] = kernel_times(lambda: first_token_s(engine, system + questions[1]), 5)
        finally:
            engine.shutdown()
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", nargs="+", default=["qwen2-1.5b"], choices=sorted(SHAPES))
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    results = []
    for name in args.shapes:
        r = probe(name)
        results.append(r)
        print(f"{name}: decode replay {r['decode_replay_ms']:.3f} ms, "
              f"cached-prefix TTFT p50 {r['cached_ttft_ms_p50']:.2f} ms")
        for part in ("decode_kernels", "cached_request_kernels"):
            print(f"  {part}: {sum(k['us'] for k in r[part]) / 1e3:.3f} ms of kernels")
            for k in r[part][:6]:
                print(f"    {k['us']:9.1f} us  x{k['calls']:5.1f}  {k['kernel']}")
    args.out.write_text(json.dumps({"command": sys.argv, "gpu": torch.cuda.get_device_name(), "results": results},
                                   indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
