"""What the first launch of each of torch's kernels costs in a fresh CUDA process, against its second launch.

A process restored from a process snapshot makes its CUDA context after the restore, so every kernel it launches
is loaded then, at its first launch, from its library's module (lazy loading). This times, in order, the ops a
greedy request with log-probabilities took through torch (a float copy, log_softmax, argmax, gather, max), those
of sampling at a temperature, Triton's ask of `ptxas --version` for the GPU's architecture, an index of the
prefill's last row, cuBLAS's first call and the projections of a 161-token prefill of Qwen2-1.5B's shapes: each
launched (or asked) twice, synchronised, in milliseconds. Run it in a fresh
process each time (the second run of an op in one process measures nothing):

    python scripts/probe_first_launch.py --out first-launch-h200.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Callable


def timed(fn: Callable[[], object], torch) -> list[float]:
    """Milliseconds of the first and the second launch of FN."""
    out = []
    for _ in range(2):
        torch.cuda.synchronize()
        started = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        out.append(round((time.perf_counter() - started) * 1000, 2))
    return out


def probe(vocab: int, hidden: int, intermediate: int, qkv: int, tokens: int) -> dict[str, list[float]]:
    import torch

    device = torch.device("cuda")
    torch.zeros(1, device=device)
    torch.cuda.synchronize()
    logits_bf16 = torch.randn(1, vocab, device=device, dtype=torch.bfloat16)
    results: dict[str, list[float]] = {}
    kept: dict[str, object] = {}

    def run(name: str, fn: Callable[[], object], keep: str | None = None) -> None:
        def launch() -> None:
            value = fn()
            if keep:
                kept[keep] = value

        results[name] = timed(launch, torch)
        print(f"{name:28s} first {results[name][0]:8.2f} ms   second {results[name][1]:6.2f} ms", flush=True)

    # greedy with the chosen token's log-probability, as torch's path in runtime/engine/sampler.py takes it
    run("float copy", lambda: logits_bf16.float(), keep="logits")
    logits = kept["logits"]
    run("log_softmax", lambda: torch.log_softmax(logits, dim=-1), keep="logprobs")
    run("argmax", lambda: logits.argmax(dim=-1), keep="tokens")
    logprobs, tokens_ = kept["logprobs"], kept["tokens"]
    run("gather", lambda: logprobs.gather(1, tokens_[:, None]))
    run("max (dim, keepdim)", lambda: logprobs.max(dim=-1, keepdim=True))
    run("copy to host", lambda: tokens_.to("cpu", non_blocking=True))
    # sampling at a temperature
    run("softmax", lambda: torch.softmax(logits, dim=-1))
    generator = torch.Generator(device=device).manual_seed(1)
    run("exponential_", lambda: torch.empty_like(logits).exponential_(generator=generator))
    run("divide", lambda: logits / torch.tensor([0.8], device=device)[:, None])
    run("argmax (bf16)", lambda: logits_bf16.argmax(dim=-1))
    # Triton's ask of ptxas for this GPU's architecture, at the first launch of a Triton kernel in a process: a
    # process snapshot is frozen with the answer (runtime/engine/kernels: ask_ptxas_for)
    try:
        from triton import knobs
        from triton.backends.nvidia.compiler import get_ptxas_version

        knobs.nvidia.ptxas  # noqa: B018 - its path and version: asked once a process, before any GPU is known
        major, minor = torch.cuda.get_device_capability()
        run("ptxas --version (Triton)", lambda: get_ptxas_version(major * 10 + minor))
    except (ImportError, RuntimeError):
        pass  # no Triton, or no ptxas in it
    # the prefill's last row picked by an index, as the engine did before it took a view
    hidden_states = torch.randn(tokens, hidden, device=device, dtype=torch.bfloat16)
    last = torch.tensor([tokens - 1], device=device)
    run("index (last row)", lambda: hidden_states[last])
    # cuBLAS: its first call in the process, then a prefill's projections
    x = torch.randn(2, 256, device=device, dtype=torch.bfloat16)
    w = torch.randn(256, 256, device=device, dtype=torch.bfloat16)
    run("cuBLAS first call", lambda: torch.nn.functional.linear(x, w))
    for n, k in ((qkv, hidden), (hidden, hidden), (2 * intermediate, hidden), (hidden, intermediate)):
        a = torch.randn(tokens, k, device=device, dtype=torch.bfloat16)
        b = torch.randn(n, k, device=device, dtype=torch.bfloat16)
        run(f"linear {tokens}x{k} -> {n}", lambda a=a, b=b: torch.nn.functional.linear(a, b))
    return results


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--vocab", type=int, default=151936, help="logits per row (Qwen2-1.5B's 151936)")
    parser.add_argument("--hidden", type=int, default=1536)
    parser.add_argument("--intermediate", type=int, default=8960)
    parser.add_argument("--qkv", type=int, default=2048, help="the fused qkv projection's outputs")
    parser.add_argument("--tokens", type=int, default=161, help="the prefill's tokens")
    parser.add_argument("--out", type=Path, help="write the results here as JSON")
    args = parser.parse_args()
    import torch

    if not torch.cuda.is_available():
        print("probe_first_launch: needs a CUDA GPU", file=sys.stderr)
        return 2
    started = time.time()
    results = probe(args.vocab, args.hidden, args.intermediate, args.qkv, args.tokens)
    if args.out:
        args.out.write_text(json.dumps({"date_utc": time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(started)),
                                        "gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
                                        "argv": sys.argv[1:], "milliseconds": results}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
