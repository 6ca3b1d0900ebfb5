"""Whether a decode graph that holds cuBLAS kernels may let the engine's kernels start their successors early
(runtime/engine/kernels/dependent_launch.py): one graph of a batch size captured with early launch on and one
with it off, each replayed many times from the same random inputs, against the same step run eagerly; and the
launch attributes the capture left on the graph's cuBLAS nodes. Prints and writes JSON.

    python scripts/probe_dependent_launch.py --shape qwen2-1.5b --batch 16 1 --replays 50 --out pdl.json
"""

from __future__ import annotations

import argparse
import ctypes
import json
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from runtime.bench.machine import describe_machine  # noqa: E402
from runtime.cuda_driver import graphs as cu  # noqa: E402
from runtime.engine import Engine  # noqa: E402
from runtime.engine.kernels import dependent_launch  # noqa: E402
from scripts.bench_decode import random_hf_model, started_engine  # noqa: E402

# CUlaunchAttributeID: programmatic stream serialization, programmatic event
DEPENDENT_ATTRIBUTES = {6: "programmatic_stream_serialization", 7: "programmatic_event"}


def random_inputs(runner, bs: int, seed: int) -> None:
    """Random tokens, positions and block tables in the decode buffers the graphs read, over a KV cache of
    random values (what the steps attend to besides the keys they write)."""
    g = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)
    for k, v in runner.kv_caches:
        k.normal_()
        v.normal_()
    d, blocks, size = runner.decode, runner.num_kv_blocks, runner.config.block_size
    positions = torch.randint(16, 200, (bs,), generator=g)
    tables = torch.randint(1, blocks, d.block_tables[:bs].shape, generator=g, dtype=torch.int32)
    d.input_ids[:bs].copy_(torch.randint(0, 1000, (bs,), generator=g))
    d.positions[:bs].copy_(positions)
    d.seq_lens[:bs].copy_(positions + 1)
    d.block_tables[:bs].copy_(tables)
    d.slot_mapping[:bs].copy_(tables[torch.arange(bs), positions // size].long() * size + positions % size)


def attribute_counts(graph) -> dict[str, int]:
    """How many of the graph's library (cuBLAS) kernel nodes carry each dependent-launch attribute."""
    counts = {name: 0 for name in DEPENDENT_ATTRIBUTES.values()}
    raw = graph.raw_cuda_graph()
    for node in cu.graph_nodes(raw):
        if cu.node_type(node) != cu.NODE_KERNEL or cu.kernel_node_name(node) in dependent_launch.ENGINE_KERNELS:
            continue
        for attribute, name in DEPENDENT_ATTRIBUTES.items():
            value = cu.AttributeValue()
            if cu.lib().cuGraphKernelNodeGetAttribute(ctypes.c_void_p(node), ctypes.c_int(attribute),
                                                      ctypes.byref(value)) == 0 and any(bytes(value)):
                counts[name] += 1
    return counts


def probe(engine: Engine, bs: int, replays: int) -> dict:
    runner = engine.runner
    random_inputs(runner, bs, seed=bs)
    logits = runner.decode.logits[:bs]
    with torch.inference_mode():
        runner._graph_forward(bs)  # eager, every kernel launched plainly
        torch.cuda.synchronize()
        eager = logits.clone()
        row = {"batch": bs}
        for early in (False, True):
            graph = runner._capture(bs, True, early)
            linked = dependent_launch.link_engine_kernels(graph.raw_cuda_graph())
            row[f"library_kernels_{early}"] = linked.library_kernels
            row[f"programmatic_edges_{early}"] = linked.programmatic_edges
            row[f"library_node_attributes_{early}"] = attribute_counts(graph)
            graph.instantiate()
            differing = 0
            for _ in range(replays):
                logits.zero_()
                graph.replay()
                torch.cuda.synchronize()
                differing += int(not torch.equal(logits, eager))
            row["early" if early else "plain"] = {"replays": replays, "differ_from_eager": differing}
            del graph
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", default="qwen2-1.5b")
    parser.add_argument("--batch", nargs="+", type=int, default=[16, 1])
    parser.add_argument("--replays", type=int, default=50)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        hf = random_hf_model(args.shape, Path(tmp))
        engine = started_engine(Path(tmp), hf, max_model_len=2048, max_num_seqs=max(args.batch),
                                gpu_memory_utilization=0.5, cuda_graph_batch_sizes=sorted(args.batch))
        del hf
        rows = [probe(engine, bs, args.replays) for bs in args.batch]
        engine.shutdown()
    for row in rows:
        print(json.dumps(row))
    if args.out:
        args.out.write_text(json.dumps({"command": sys.argv, "machine": describe_machine(), "shape": args.shape,
                                        "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
