"""What backing and giving back a model's weight segments costs through CUDA's virtual memory API, as a
multi-model pool does on a switch (runtime/pool, runtime/engine/vmm.py).

A model's weights are split into segments (about one decoder layer each, and the 2 MiB granules two layers
share); a chunk of its KV cache is one granule in each of its planes (a plane per layer and keys or values:
runtime/pool/kv.py). For the weight segments of SHAPE (rows `weights`) and for one KV chunk (rows `kv_chunk`)
this times:

- create_map:      cuMemCreate + cuMemMap + cuMemSetAccess per part (new physical memory)
- unmap_release:   one device synchronise, then cuMemUnmap + cuMemRelease per part (memory given back, as the
                   pool does it)
- sync_each:       the same with a synchronise before each part
- unmap_keep:      cuMemUnmap per part after one synchronise (the physical memory kept for reuse)
- map_kept:        cuMemMap + cuMemSetAccess of kept memory per part (no cuMemCreate)

    python -m scripts.probe_vmm --shape qwen2-1.5b --repeat 5 --out vmm-h100.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

from runtime.cuda_driver import allocation_prop, call, granularity, map_range, reserve
from scripts.model_shapes import SHAPES


def segment_sizes(shape: str, granule: int) -> list[int]:
    """One segment per decoder layer, the embedding's, and a shared granule between each two."""
    config = SHAPES[shape]
    h, i = config["hidden_size"], config["intermediate_size"]
    kv = config["num_key_value_heads"] * h // config["num_attention_heads"]
    layer = 2 * (2 * h * h + 2 * kv * h + 3 * h * i)
    embedding = 2 * config["vocab_size"] * h

    def whole(n: int) -> int:
        return max(granule, n // granule * granule)

    sizes = [whole(embedding)]
    for _ in range(config["num_hidden_layers"]):
        sizes += [granule, whole(layer - granule)]
    return sizes


def kv_chunk_sizes(shape: str, granule: int) -> list[int]:
    """One granule in each plane: 2 per decoder layer."""
    return [granule] * (2 * SHAPES[shape]["num_hidden_layers"])


def timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def one_round(sizes: list[int], device: int) -> dict[str, float]:
    from cuda.bindings import driver as d

    prop = allocation_prop(device)
    base, size = reserve(prop, sum(sizes))
    offsets = [sum(sizes[:k]) for k in range(len(sizes))]
    handles: list = []

    def create_map() -> None:
        handles.clear()
        for off, n in zip(offsets, sizes):
            h = call(d.cuMemCreate(n, prop, 0), "cuMemCreate")
            map_range(base + off, n, h, device)
            handles.append(h)

    def unmap_release(sync_each: bool = False) -> None:
        call(d.cuCtxSynchronize(), "cuCtxSynchronize")
        for off, n, h in zip(offsets, sizes, handles):
            if sync_each:
                call(d.cuCtxSynchronize(), "cuCtxSynchronize")
            call(d.cuMemUnmap(base + off, n), "cuMemUnmap")
            call(d.cuMemRelease(h), "cuMemRelease")

    def unmap_keep() -> None:
        call(d.cuCtxSynchronize(), "cuCtxSynchronize")
        for off, n in zip(offsets, sizes):
            call(d.cuMemUnmap(base + off, n), "cuMemUnmap")

    def map_kept() -> None:
        for off, n, h in zip(offsets, sizes, handles):
            map_range(base + off, n, h, device)

    out = {"create_map": timed(create_map), "unmap_release": timed(unmap_release)}
    create_map()
    out["sync_each"] = timed(lambda: unmap_release(sync_each=True))
    create_map()
    out["unmap_keep"] = timed(unmap_keep)
    out["map_kept"] = timed(map_kept)
    unmap_release()
    call(d.cuMemAddressFree(base, size), "cuMemAddressFree")
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", action="append", help="model shape(s) (default qwen2-1.5b and llama-3-8b)")
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    import torch

    torch.cuda.init()
    torch.zeros(1, device="cuda")  # the primary context, current on this thread
    granule = granularity(allocation_prop(0))
    results = []
    for shape in args.shape or ["qwen2-1.5b", "llama-3-8b"]:
        for what, sizes in (("weights", segment_sizes(shape, granule)), ("kv_chunk", kv_chunk_sizes(shape, granule))):
            rounds = [one_round(sizes, 0) for _ in range(args.repeat)]
            row = {"shape": shape, "what": what, "parts": len(sizes), "bytes": sum(sizes),
                   **{k: statistics.median(r[k] for r in rounds) for k in rounds[0]}, "rounds": rounds}
            results.append(row)
            print(f"{shape} {what}: {len(sizes)} parts, {sum(sizes) / 2**20:.0f} MiB; median of {args.repeat}: "
                  + ", ".join(f"{k} {row[k] * 1e3:.2f} ms" for k in rounds[0]), flush=True)
    report = {"device": torch.cuda.get_device_name(0), "driver": torch.version.cuda, "granule": granule,
              "repeat": args.repeat, "results": results}
    if args.out:
        args.out.write_text(json.dumps(report, indent=1) + "\n")


if __name__ == "__main__":
    main()
