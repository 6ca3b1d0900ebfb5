"""Materialised state (Medusa): the KV-cache size and the decode CUDA graphs, baked once, restored at boot.

Bake (`bake_materialized`, called by faas-build on the GPU): start the engine the cold way (profiling forward
included), capture and describe the graphs, replay each on fixed inputs, then have a *separate process* boot
from the description and replay the restored graphs on the same inputs. Only if every graph's output is
bit-identical is the directory renamed into place; otherwise nothing is written and the reasons are returned.

Layout of `<snapshot dir>/materialized/`: kvprofile.json, engine.json (what was baked), fingerprint.json,
graphs.json, params.bin, segment-*.bin, and digests.json, written last: every other file's digest, checked
before the state is used (snapshots/integrity.py).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import subprocess
import sys
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from runtime.engine.engine_config import EngineConfig
from runtime.engine.model_runner import KVProfile
from runtime.logs import get_logger

if TYPE_CHECKING:
    from runtime.engine import Engine
    from runtime.pool.pool import ModelPool

log = get_logger("snapshots.materialized")

DIRNAME = "materialized"
#: the Fingerprint (snapshots/fingerprint.py) it was baked against; the restore paths check it
FINGERPRINT = "fingerprint.json"
#: {"hash": ..., "files": {name: digest}} of every other file, written last
DIGESTS = "digests.json"


def write_digests(directory: Path) -> None:
    from snapshots.integrity import HASH, digest_files

    names = sorted(p.name for p in directory.iterdir() if p.is_file() and p.name != DIGESTS)
    (directory / DIGESTS).write_text(json.dumps({"hash": HASH, "files": digest_files(directory, names)}, indent=1))


class MaterializeError(RuntimeError):
    pass


@dataclass
class BakeReport:
    kv_blocks: int
    graphs: int
    capture_s: float
    validated: bool
    problems: dict[int, list[str]]


def bake_materialized(model_dir: Path, config: EngineConfig, snapshot_dir: Path,
                      fingerprint: dict | None = None, pooled: bool = False) -> BakeReport:
    """FINGERPRINT: `current_fingerprint(settings).as_dict()` of the function's settings; without it the
    restore paths do not use the result. POOLED: for a model of a several-model instance, whose KV cache is
    the pool's address range of blocks backed on demand (runtime/pool/kv.py: KVMemory.size): the engine is
    started in a pool of its own, so that the graphs are captured against the buffers it will have there."""
    import time

    from snapshots.cudagraph.materialize import capture_and_describe
    from snapshots.cudagraph.probe import probe_graphs

    started = _started_engine(model_dir, config, pooled)
    engine, runner = started.engine, started.engine.runner
    t0 = time.perf_counter()
    materialized = capture_and_describe(runner)
    capture_s = time.perf_counter() - t0
    if materialized.problems:
        blocks = runner.num_kv_blocks
        del runner
        started.shutdown()
        return BakeReport(blocks, 0, capture_s, False, materialized.problems)
    expected = probe_graphs(runner, usable_blocks=started.usable_blocks)
    final = snapshot_dir / DIRNAME
    snapshot_dir.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{DIRNAME}-", dir=snapshot_dir))
    try:
        materialized.graph_set.save(tmp, materialized.params)
        for ordinal, data in materialized.segment_contents.items():
            (tmp / f"segment-{ordinal}.bin").write_bytes(data)
        profile = engine.kv_profile or KVProfile(runner.num_kv_blocks, runner.kv_block_bytes, 0, 0, 0)
        (tmp / "kvprofile.json").write_text(json.dumps({**profile.as_dict(), "pooled": pooled}, indent=1))
        if fingerprint is not None:
            (tmp / FINGERPRINT).write_text(json.dumps(fingerprint, indent=1))
        (tmp / "engine.json").write_text(json.dumps({"model_dir": str(model_dir), "config": asdict(config),
                                                    "pooled": pooled}))
        write_digests(tmp)
        del runner  # the last reference besides the engine's: shutdown can then hand the memory back
        started.shutdown()
        restored = _validate_in_new_process(tmp)
        differ = sorted(bs for bs, digest in expected.items() if restored.get(str(bs)) != digest)
        if differ:
            problems = {bs: ["restored graph's output differs from the captured graph's"] for bs in differ}
            return BakeReport(profile.num_blocks, len(expected), capture_s, False, problems)
        if final.exists():
            shutil.rmtree(final)
        os.rename(tmp, final)
        return BakeReport(profile.num_blocks, len(expected), capture_s, True, {})
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def bake_materialized_apart(model_dir: Path, config: EngineConfig, snapshot_dir: Path,
                            fingerprint: dict | None = None, pooled: bool = False) -> BakeReport:
    """`bake_materialized` in a process of its own: faas-build bakes the models of a several-model function
    one after another, and a capture must find nothing an earlier model's bake left in the process (a
    Llama-3-8B baked after a Qwen2-1.5B in one process failed its validation on the H100)."""
    spec = {"model_dir": str(model_dir), "config": asdict(config), "snapshot_dir": str(snapshot_dir),
            "fingerprint": fingerprint, "pooled": pooled,
            "log_level": logging.getLevelName(logging.getLogger("thawllm").getEffectiveLevel())}
    with tempfile.NamedTemporaryFile("w", suffix=".json") as f:
        json.dump(spec, f)
        f.flush()
        report = _in_child("--bake", Path(f.name), 3600, "the bake's process")  # its log goes where ours does
    return BakeReport(**{**report, "problems": {int(bs): why for bs, why in report["problems"].items()}})


def _bake_from_spec(path: Path) -> BakeReport:
    from runtime.logs import setup_logging

    spec = json.loads(path.read_text())
    setup_logging(spec["log_level"])
    return bake_materialized(Path(spec["model_dir"]), _engine_config(spec["config"]), Path(spec["snapshot_dir"]),
                             spec["fingerprint"], spec["pooled"])


def _engine_config(fields: dict) -> EngineConfig:
    return EngineConfig(**{**fields, "cuda_graph_batch_sizes": tuple(fields["cuda_graph_batch_sizes"])})


def _validate_in_new_process(directory: Path) -> dict[str, str]:
    return _in_child("--probe", directory, 1800, "validation process", quiet=True)


def _in_child(action: str, path: Path, timeout_s: int, what: str, quiet: bool = False) -> dict:
    """This module run as `python -m snapshots.materialized ACTION PATH`: the JSON its output ends with. QUIET:
    its log is kept, and its tail goes into the error if it fails; else it goes where this process's goes."""
    result = subprocess.run([sys.executable, "-m", "snapshots.materialized", action, str(path)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE if quiet else None, text=True,
                            timeout=timeout_s)
    if result.returncode != 0:
        tail = "\n".join(result.stderr.strip().splitlines()[-25:]) if quiet else "its log is above"
        raise MaterializeError(f"{what} failed:\n{tail}")
    return json.loads(result.stdout.strip().splitlines()[-1])


def load_kv_blocks(directory: Path) -> int:
    return json.loads((directory / "kvprofile.json").read_text())["num_blocks"]


def baked_pooled(directory: Path) -> bool:
    """Whether the state was baked for a model of a several-model instance (its KV cache the pool's)."""
    return bool(json.loads((directory / "kvprofile.json").read_text()).get("pooled", False))


@dataclass
class _Started:
    """An engine started for the bake or its check, alone or in a pool of its own."""

    engine: "Engine"
    pool: "ModelPool | None"
    usable_blocks: int | None  # the KV blocks the graph probe may use (None: all of them)

    def shutdown(self) -> None:
        self.pool.shutdown() if self.pool is not None else self.engine.shutdown()


def _started_engine(model_dir: Path, config: EngineConfig, pooled: bool, restorer=None,
                    kv_blocks: int | None = None) -> _Started:
    """Started without graphs (RESTORER None: the bake captures them) or with them restored."""
    from runtime.launch import build_engine

    engine = build_engine(model_dir, config)
    if not pooled:
        if restorer is None:
            engine.start(capture_graphs=False)
        else:
            engine.start(kv_blocks=kv_blocks, graph_restorer=restorer)
        return _Started(engine, None, None)
    import torch

    from runtime.pool.pool import ModelPool, device_budget
    from snapshots.cudagraph.probe import blocks_needed

    device = torch.device(config.device)
    pool = ModelPool(device, device_budget(device, config.gpu_memory_utilization, None),
                     capture_graphs=restorer is not None)
    pool.add(engine.model_name, engine, restorer)
    pool.activate(engine.model_name)
    wanted = blocks_needed(engine.runner)
    backed = pool.back_kv_blocks(engine.model_name, wanted)
    return _Started(engine, pool, backed - engine.runner.reserved_blocks)


def _probe(directory: Path) -> dict[int, str]:
    """Boot from a materialised directory and fingerprint every restored graph's output."""
    from snapshots.cudagraph.probe import probe_graphs
    from snapshots.cudagraph.restore import MaterializedGraphs

    spec = json.loads((directory / "engine.json").read_text())
    config = _engine_config(spec["config"])
    started = _started_engine(Path(spec["model_dir"]), config, bool(spec.get("pooled", False)),
                              MaterializedGraphs(directory), load_kv_blocks(directory))
    engine = started.engine
    if engine.graph_fallbacks:
        raise MaterializeError(f"graphs not restored: {engine.graph_fallbacks}")
    return probe_graphs(engine.runner, usable_blocks=started.usable_blocks)


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    action = parser.add_mutually_exclusive_group(required=True)
    action.add_argument("--probe", type=Path, help="a baked directory: its restored graphs' output digests")
    action.add_argument("--bake", type=Path, help="a JSON spec of bake_materialized's arguments: its report")
    args = parser.parse_args()
    if args.bake is not None:
        print(json.dumps(asdict(_bake_from_spec(args.bake))), flush=True)
    else:
        print(json.dumps({str(k): v for k, v in _probe(args.probe).items()}), flush=True)
    # the answer is out: the interpreter's teardown with an engine's threads still running (a pooled one's
    # among them ended in std::terminate) is not what this process checks
    os._exit(0)
