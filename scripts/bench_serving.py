"""Serving figures of one engine in one process: offline throughput, prefix caching's time to first token,
and the inter-token latency of running decodes while long prompts arrive (chunked prefill).

For each model shape (random weights of the real shape, the same in the engine and in transformers):

1. throughput: at each batch size, that many requests at once, prompt and output lengths drawn like
   ShareGPT's (runtime/bench/workload.py); output tokens/s of the engine and of transformers' batched
   `generate` (left-padded, every row generating the longest output; only the tokens the requests asked
   for are counted; run before the engine starts, so that its KV cache has the memory), and the engine's
   median decode step against the HBM roofline (weight bytes / HBM bandwidth: the least time a step can
   take reading every weight once; KV reads not counted);
2. prefix: a shared system prompt (2,000 tokens) with short questions, one request at a time: time to
   first token with prefix caching and without (the same engine, the cache switched off and emptied), and
   with the cache but the questions' tokens computed eagerly rather than as rows of a decode graph
   (`cached_eager`: GRAPH_PREFILL_TOKENS 0, docs/engine.md);
3. mix: decode streams (32) run while long prompts (4,000 tokens) arrive one after another: inter-token
   latency p50/p99 of the streams while the prompts are prefilled, with chunked prefill (the step budget,
   `--budget`) and without (a budget that takes a whole prompt in one step).

Prints progress as it goes, then a table, and writes one JSON (default: serving-<device>-<shapes>.json).

    python scripts/bench_serving.py --shapes qwen2-1.5b llama-3-8b                # the GPU machine
    python scripts/bench_serving.py --model /tmp/thawllm-models/llama-3-8b        # a model directory
    python scripts/bench_serving.py --device cpu --shapes tiny --batch 1 4 --system-tokens 160 \\
        --questions 3 --streams 3 --long-tokens 300 --long-prompts 2 --budget 48 --max-model-len 1024
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from runtime.bench.workload import WorkloadShape, make_workload  # noqa: E402
from runtime.engine import Engine, EngineConfig, SamplingParams  # noqa: E402
from scripts.bench_decode import copy_from  # noqa: E402
from scripts.model_shapes import SHAPES, write_config_and_tokenizer  # noqa: E402

PARTS = ("throughput", "prefix", "mix")
#: HBM bandwidth by GPU name (bytes/s); --hbm-tb-s overrides
HBM_BYTES_PER_S = {"H200": 4.8e12, "H100 PCIe": 2.0e12, "H100": 3.35e12}


def progress(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q / 100 * len(ordered)))]


def random_tokens(n: int, rng: torch.Generator, vocab: int) -> list[int]:
    return torch.randint(10, vocab, (n,), generator=rng).tolist()


async def _stream(engine: Engine, prompt: list[int], params: SamplingParams, stamps: list[float],
                  stop: asyncio.Event | None = None) -> None:
    async for out in engine.generate(prompt, params):
        stamps.extend([time.perf_counter()] * len(out.token_ids))
        if stop is not None and stop.is_set():
            break  # leaving the generator aborts the request


# -- 1. throughput -----------------------------------------------------------------------------------

def sharegpt_lengths(n: int, max_len: int, seed: int) -> list[tuple[int, int]]:
    requests = make_workload(WorkloadShape(rate=1.0, duration_s=8.0 * n + 50, max_len=max_len, seed=seed))
    return [(r.prompt_tokens, r.output_tokens) for r in requests[:n]]


def engine_throughput(engine: Engine, prompts: list[list[int]], outputs: list[int]) -> dict:
    async def run():
        stamps = [[] for _ in prompts]
        started = time.perf_counter()
        await asyncio.gather(*[_stream(engine, p, SamplingParams(max_tokens=n, temperature=0, ignore_eos=True), s)
                               for p, n, s in zip(prompts, outputs, stamps)])
        return time.perf_counter() - started, stamps

    seconds, stamps = asyncio.run(run())
    # decode steps while every request still runs: the gaps of each request up to the first one's end
    everyone = min(s[-1] for s in stamps)
    gaps = [b - a for s in stamps for a, b in zip(s, s[1:]) if b <= everyone]
    return {"seconds": seconds, "output_tok_s": sum(outputs) / seconds,
            "total_tok_s": (sum(outputs) + sum(map(len, prompts))) / seconds,
            "decode_step_ms": statistics.median(gaps) * 1e3 if gaps else None}


def hf_throughput(model, prompts: list[list[int]], outputs: list[int], device: str) -> dict:
    width = max(map(len, prompts))
    ids = torch.zeros(len(prompts), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(prompts):  # left padding: every row's next token at the same position
        ids[i, width - len(p):] = torch.tensor(p)
        mask[i, width - len(p):] = 1
    n = max(outputs)
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    sync()
    started = time.perf_counter()
    model.generate(ids.to(device), attention_mask=mask.to(device), max_new_tokens=n, min_new_tokens=n,
                   do_sample=False, pad_token_id=0)
    sync()
    seconds = time.perf_counter() - started
    return {"seconds": seconds, "output_tok_s": sum(outputs) / seconds,
            "generated_tok_s": n * len(prompts) / seconds}


def throughput_workloads(args, vocab: int) -> dict[int, tuple[list[list[int]], list[int]]]:
    rng = torch.Generator().manual_seed(1)
    workloads = {}
    for batch in args.batch:
        lengths = sharegpt_lengths(batch, args.max_len, seed=batch)
        workloads[batch] = [random_tokens(p, rng, vocab) for p, _ in lengths], [o for _, o in lengths]
    return workloads


def bench_hf_throughput(hf, workloads: dict, device: str) -> dict[int, dict]:
    """Before the engine starts, so that transformers' KV cache has the GPU's memory to itself."""
    hf.generate(torch.tensor([[11, 12, 13]], device=device), max_new_tokens=2, do_sample=False, pad_token_id=0)
    rows = {}
    for batch, (prompts, outputs) in workloads.items():
        rows[batch] = hf_throughput(hf, prompts, outputs, device)
        progress(f"  transformers batch {batch}: {rows[batch]['output_tok_s']:.0f} output tok/s")
    return rows


def bench_throughput(engine: Engine, workloads: dict, hf_rows: dict[int, dict], hbm: float | None) -> list[dict]:
    rows = []
    for batch, (prompts, outputs) in workloads.items():
        row = {"batch": batch, "prompt_tokens": sum(map(len, prompts)), "output_tokens": sum(outputs),
               "engine": engine_throughput(engine, prompts, outputs)}
        if batch in hf_rows:
            row["transformers"] = hf_rows[batch]
            row["engine_vs_transformers"] = row["engine"]["output_tok_s"] / row["transformers"]["output_tok_s"]
        step_ms = row["engine"]["decode_step_ms"]
        if hbm is not None and step_ms:
            row["roofline_step_ms"] = engine.plan.total_bytes / hbm * 1e3
            row["roofline_fraction"] = row["roofline_step_ms"] / step_ms
        rows.append(row)
        progress(f"  engine batch {batch}: {row['engine']['output_tok_s']:.0f} output tok/s")
    return rows


# -- 2. prefix caching -------------------------------------------------------------------------------

def time_to_first_token(engine: Engine, prompt: list[int]) -> tuple[float, int]:
    async def run():
        started = time.perf_counter()
        async for out in engine.generate(prompt, SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)):
            return time.perf_counter() - started, out.cached_tokens
    return asyncio.run(run())


def bench_prefix(engine: Engine, args, vocab: int) -> dict:
    rng = torch.Generator().manual_seed(2)
    system = random_tokens(args.system_tokens, rng, vocab)
    questions = [random_tokens(args.question_tokens, rng, vocab) for _ in range(args.questions + 1)]
    result = {"system_tokens": len(system), "question_tokens": args.question_tokens, "questions": args.questions}
    runner, config = engine.runner, engine.runner.config
    for mode, caching, rows in (("cached", True, True), ("cached_eager", True, False), ("uncached", False, True)):
        engine.blocks.prefix_caching = caching
        engine.blocks.reset_prefix_cache()
        runner.config = config if rows else dataclasses.replace(config, graph_prefill_tokens=0)
        time_to_first_token(engine, system + questions[0])  # fills the cache (cached), warms up (uncached)
        runs = [time_to_first_token(engine, system + q) for q in questions[1:]]
        ttft = [t for t, _ in runs]
        result[mode] = {"ttft_ms_p50": statistics.median(ttft) * 1e3, "ttft_ms_max": max(ttft) * 1e3,
                        "cached_tokens": [c for _, c in runs]}
        progress(f"  prefix {mode}: TTFT p50 {result[mode]['ttft_ms_p50']:.1f} ms")
    runner.config = config
    engine.blocks.prefix_caching = True
    engine.blocks.reset_prefix_cache()
    result["uncached_vs_cached"] = result["uncached"]["ttft_ms_p50"] / result["cached"]["ttft_ms_p50"]
    return result


# -- 3. long prompts during decodes ------------------------------------------------------------------

def decodes_during_long_prompts(engine: Engine, args, vocab: int, budget: int) -> dict:
    rng = torch.Generator().manual_seed(3)
    engine.scheduler.max_num_batched_tokens = budget
    engine.blocks.prefix_caching = False
    streams = [random_tokens(args.stream_prompt_tokens, rng, vocab) for _ in range(args.streams)]
    longs = [random_tokens(args.long_tokens, rng, vocab) for _ in range(args.long_prompts)]
    stream_tokens = engine.max_model_len - args.stream_prompt_tokens

    async def run():
        stop = asyncio.Event()
        stamps = [[] for _ in streams]
        tasks = [asyncio.ensure_future(_stream(engine, p, SamplingParams(max_tokens=stream_tokens, temperature=0,
                                                                         ignore_eos=True), s, stop))
                 for p, s in zip(streams, stamps)]
        while min(map(len, stamps)) < 8:  # every stream decoding
            await asyncio.sleep(0.001)
        window_start = time.perf_counter()
        ttft = []
        for prompt in longs:
            before = len(stamps[0])
            started = time.perf_counter()
            await _stream(engine, prompt, SamplingParams(max_tokens=1, temperature=0, ignore_eos=True), [])
            ttft.append(time.perf_counter() - started)
            while len(stamps[0]) < before + 4 and not tasks[0].done():  # a few plain decode steps between
                await asyncio.sleep(0.001)
        window_end = time.perf_counter()
        stop.set()
        await asyncio.gather(*tasks)
        return window_start, window_end, stamps, ttft

    window_start, window_end, stamps, ttft = asyncio.run(run())
    engine.blocks.prefix_caching = True
    engine.scheduler.max_num_batched_tokens = engine.config.max_num_batched_tokens
    gaps = [b - a for s in stamps for a, b in zip(s, s[1:]) if window_start <= a and b <= window_end]
    if not gaps:
        raise RuntimeError("the decode streams produced no tokens while the long prompts ran")
    p50, p99 = statistics.median(gaps), percentile(gaps, 99)
    return {"budget": budget, "itl_ms_p50": p50 * 1e3, "itl_ms_p99": p99 * 1e3, "itl_ms_max": max(gaps) * 1e3,
            "p99_vs_p50": p99 / p50, "gaps": len(gaps), "long_ttft_ms_p50": statistics.median(ttft) * 1e3}


def bench_mix(engine: Engine, args, vocab: int) -> dict:
    whole = args.long_tokens + args.streams
    result = {"streams": args.streams, "long_tokens": args.long_tokens, "long_prompts": args.long_prompts}
    for mode, budget in (("chunked", args.budget or engine.config.max_num_batched_tokens), ("whole", whole)):
        result[mode] = decodes_during_long_prompts(engine, args, vocab, budget)
        r = result[mode]
        progress(f"  mix {mode} (budget {budget}): ITL p50 {r['itl_ms_p50']:.1f} ms, p99 {r['itl_ms_p99']:.1f} ms")
    return result


# -- the run -----------------------------------------------------------------------------------------

def hbm_bandwidth(args) -> float | None:
    if args.hbm_tb_s:
        return args.hbm_tb_s * 1e12
    if args.device != "cuda":
        return None
    name = torch.cuda.get_device_name()
    return next((bw for key, bw in HBM_BYTES_PER_S.items() if key in name), None)


def load_model(name: str, model_dir: Path | None, tmp: Path, device: str, dtype: torch.dtype):
    """transformers' model: from `model_dir` (a Hugging Face directory), else random weights of the shape
    `name` (its config and a tokenizer written to `tmp`). Returns (model, directory)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    if model_dir is not None:
        progress(f"{name}: loading {model_dir} on {device}")
        return AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).to(device).eval(), model_dir
    write_config_and_tokenizer(tmp, SHAPES[name], dtype=str(dtype).removeprefix("torch."))
    torch.manual_seed(0)
    progress(f"{name}: random weights on {device}")
    with torch.device(device):
        return AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(tmp), dtype=dtype).eval(), tmp


def bench_shape(name: str, model_dir: Path | None, args) -> dict:
    dtype = torch.bfloat16 if args.device == "cuda" else torch.float32
    with tempfile.TemporaryDirectory() as tmp:
        hf, model_dir = load_model(name, model_dir, Path(tmp), args.device, dtype)
        workloads = throughput_workloads(args, hf.config.vocab_size)
        hf_rows = {}
        if "throughput" in args.parts and not args.no_transformers:
            progress(f"{name}: transformers throughput")
            hf_rows = bench_hf_throughput(hf, workloads, args.device)
            if args.device == "cuda":
                torch.cuda.empty_cache()
        max_seqs = max(max(args.batch), args.streams + 1)
        config = EngineConfig(device=args.device, dtype=str(dtype).removeprefix("torch."),
                              max_model_len=args.max_model_len, max_num_seqs=max_seqs,
                              max_num_batched_tokens=args.budget or EngineConfig.max_num_batched_tokens,
                              gpu_memory_utilization=0.85)
        engine = Engine.build(model_dir, copy_from(hf.state_dict()), config)
        del hf  # the engine's loader keeps the weights it copies from: both copies stay on the device
        engine.start()
        vocab = engine.model_config.vocab_size
        progress(f"{name}: warm-up")
        engine_throughput(engine, [random_tokens(64, torch.Generator().manual_seed(0), vocab)] * 2, [8, 8])
        progress(f"{name}: engine throughput")
        result = {"shape": name, "weight_bytes": engine.plan.total_bytes, "hbm_bytes_per_s": hbm_bandwidth(args),
                  "engine_config": config.as_dict()}
        if "throughput" in args.parts:
            result["throughput"] = bench_throughput(engine, workloads, hf_rows, hbm_bandwidth(args))
        if "prefix" in args.parts:
            progress(f"{name}: prefix caching")
            result["prefix"] = bench_prefix(engine, args, vocab)
        if "mix" in args.parts:
            progress(f"{name}: long prompts during decodes")
            result["mix"] = bench_mix(engine, args, vocab)
        engine.shutdown()
    return result


def _cell(value: float | None, spec: str, width: int) -> str:
    return f"{value:>{width}{spec}}" if value is not None else f"{'-':>{width}}"


def print_table(results: list[dict]) -> None:
    print(f"\n{'shape':<12} {'batch':>5} {'engine tok/s':>12} {'hf tok/s':>9} {'vs hf':>6} {'step ms':>8} "
          f"{'roofline':>8}")
    for r in results:
        for t in r.get("throughput", []):
            hf, step = t.get("transformers", {}).get("output_tok_s"), t["engine"]["decode_step_ms"]
            print(f"{r['shape']:<12} {t['batch']:>5} {t['engine']['output_tok_s']:>12.0f} {_cell(hf, '.0f', 9)} "
                  f"{_cell(t.get('engine_vs_transformers'), '.2f', 6)} {_cell(step, '.2f', 8)} "
                  f"{_cell(t.get('roofline_fraction'), '.0%', 8)}")
    print(f"\n{'shape':<12} {'system':>6} {'TTFT cached ms':>15} {'cached, eager ms':>17} {'TTFT uncached ms':>17} "
          f"{'ratio':>6}")
    for r in results:
        p = r.get("prefix")
        if p is None:
            continue
        print(f"{r['shape']:<12} {p['system_tokens']:>6} {p['cached']['ttft_ms_p50']:>15.1f} "
              f"{p['cached_eager']['ttft_ms_p50']:>17.1f} {p['uncached']['ttft_ms_p50']:>17.1f} "
              f"{p['uncached_vs_cached']:>6.1f}")
    print(f"\n{'shape':<12} {'mode':<8} {'budget':>6} {'ITL p50 ms':>10} {'ITL p99 ms':>10} {'p99/p50':>7} "
          f"{'long TTFT ms':>12}")
    for r in results:
        for mode in ("chunked", "whole") if "mix" in r else ():
            m = r["mix"][mode]
            print(f"{r['shape']:<12} {mode:<8} {m['budget']:>6} {m['itl_ms_p50']:>10.1f} {m['itl_ms_p99']:>10.1f} "
                  f"{m['p99_vs_p50']:>7.1f} {m['long_ttft_ms_p50']:>12.1f}")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", nargs="+", default=["qwen2-1.5b", "llama-3-8b"], choices=sorted(SHAPES),
                        help="random weights of these shapes (scripts/model_shapes.py)")
    parser.add_argument("--model", type=Path, help="a Hugging Face model directory instead of --shapes")
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    parser.add_argument("--batch", nargs="+", type=int, default=[1, 8, 32, 64, 128])
    parser.add_argument("--max-len", type=int, default=1024, help="longest prompt + output of the throughput")
    parser.add_argument("--max-model-len", type=int, default=8192)
    parser.add_argument("--budget", type=int, help="MAX_NUM_BATCHED_TOKENS (default: the engine's)")
    parser.add_argument("--system-tokens", type=int, default=2000)
    parser.add_argument("--question-tokens", type=int, default=24)
    parser.add_argument("--questions", type=int, default=16)
    parser.add_argument("--streams", type=int, default=32)
    parser.add_argument("--stream-prompt-tokens", type=int, default=128)
    parser.add_argument("--long-tokens", type=int, default=4000)
    parser.add_argument("--long-prompts", type=int, default=4)
    parser.add_argument("--hbm-tb-s", type=float, help="HBM bandwidth (default: from the GPU's name)")
    parser.add_argument("--parts", nargs="+", default=list(PARTS), choices=PARTS, help="which figures (default all)")
    parser.add_argument("--no-transformers", action="store_true")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args(argv)
    if args.model is not None and not (args.model / "config.json").is_file():
        parser.exit(2, f"bench_serving: --model {args.model}: no config.json there\n")
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.exit(2, "bench_serving: --device cuda but no CUDA GPU is visible (use --device cpu)\n")
    longest = max(args.system_tokens + args.question_tokens, args.long_tokens, args.max_len) + 1
    if longest > args.max_model_len:
        parser.exit(2, f"bench_serving: --max-model-len {args.max_model_len} is shorter than the longest "
                       f"request ({longest} tokens)\n")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    models = [(args.model.name, args.model)] if args.model is not None else [(s, None) for s in args.shapes]
    out = args.out or Path(f"serving-{args.device}-{'-'.join(name for name, _ in models)}.json")
    results = [bench_shape(name, model_dir, args) for name, model_dir in models]
    print_table(results)
    gpu = torch.cuda.get_device_name() if args.device == "cuda" else None
    out.write_text(json.dumps({"command": sys.argv, "date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
                               "device": args.device, "gpu": gpu, "results": results}, indent=2))
    progress(f"wrote {out}")


if __name__ == "__main__":
    main()
