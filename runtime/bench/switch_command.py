"""`faas-bench switch`: several models in one instance. The switch latency probes (switch.py; the partial state
in switch_partial.py) beside a fresh instance of B on its fastest restore path and B loaded by transformers
(coldstart.py), B's first activations (switch_first.py), then the multi-model trace (multi_trace.py). Writes
switch-latency.json, multi-model-trace.json, switch.md and switch.png."""

from __future__ import annotations

import argparse
import dataclasses
import shutil
import subprocess
import sys
from pathlib import Path

from runtime.bench import BenchError
from runtime.bench.coldstart import ColdStartPlan, run_coldstart
from runtime.bench.instance import SOURCE_ROOT, child_environment
from runtime.bench.machine import describe_machine
from runtime.bench.multi_trace import SystemPoint, run_per_model, run_pool, zipf_models
from runtime.bench.plots import plot_switch, switch_title
from runtime.bench.prompt import PromptMaker
from runtime.bench.records import BASELINE_MODE, ModeResult
from runtime.bench.report import provenance, write_json
from runtime.bench.switch import STATES, SwitchProbe, in_instance, probe, probe_targets
from runtime.bench.switch_budget import GiB, default_pool_bytes, gpu_memory_bytes, pool_budget
from runtime.bench.switch_first import (FirstActivationProbe, boot_order, first_activations, first_table,
                                        model_setting, separate_instances)
from runtime.bench.switch_models import BenchModel, make_models
from runtime.bench.switch_partial import filler, probe_partial
from runtime.bench.workload import WorkloadShape, make_workload
from runtime.logs import get_logger
from runtime.server.routing import POLICIES

log = get_logger("bench")

#: the states probed in the instance of every model; the partial one has instances of its own (switch_partial.py)
SHARED_STATES = ("retained", "evicted")


async def run_switch_command(args: argparse.Namespace, settings: dict[str, str]) -> int:
    args.out.mkdir(parents=True, exist_ok=True)
    settings = {"MAX_MODEL_LEN": str(args.max_len), "MAX_NUM_SEQS": "16", **settings}
    log_dir = args.out / "logs"
    models_dir = args.models_dir or args.out / "models"
    log.info("switch: making %s in %s", ", ".join(f"{n} x {s}" for s, n in args.shapes), models_dir)
    models = make_models(args.shapes, models_dir, int(args.chunk_mb * 2**20), log_dir)
    pool_bytes = int(args.pool_gb * GiB) if args.pool_gb else default_pool_bytes([m.nbytes for m in models])
    device = settings.get("DEVICE", "auto")
    base = {**settings, "MODEL": model_setting(models),
            **pool_budget(pool_bytes, device)}
    prompts = PromptMaker(str(models[0].hf_dir))
    context = {"command": "switch", "argv": args.argv, "machine": describe_machine(), "settings": settings,
               "models": [dataclasses.asdict(m) | {"hf_dir": str(m.hf_dir), "layout_dir": str(m.layout_dir)}
                          for m in models], "pool_bytes": pool_bytes}
    probes, firsts, fresh = await _switch_latency(args, base, models, prompts, settings, log_dir)
    write_json(args.out / "switch-latency.json", {**context, "probes": [dataclasses.asdict(p) for p in probes],
                                                 "first_activations": [dataclasses.asdict(f) for f in firsts],
                                                 "fresh": {k: dataclasses.asdict(v) for k, v in fresh.items()}})
    points = await _trace(args, base, models, prompts, settings, pool_bytes, log_dir)
    write_json(args.out / "multi-model-trace.json", {**context, "rates": args.rates, "duration_s": args.duration,
                                                    "zipf": args.zipf, "seed": args.seed,
                                                    "points": [dataclasses.asdict(p) for p in points]})
    tables = "\n\n".join([provenance(context), probe_table(probes, fresh)] + ([first_table(firsts)] if firsts else [])
                         + [trace_table(points)])
    (args.out / "switch.md").write_text(tables + "\n")
    plot_switch([dataclasses.asdict(p) for p in probes], {k: _fastest_s(v) for k, v in fresh.items()},
                [dataclasses.asdict(p) for p in points if p.status == "ok"], args.out / "switch.png",
                switch_title(context))
    print(tables)
    print(f"\nwrote {args.out / 'switch-latency.json'}, {args.out / 'multi-model-trace.json'}, "
          f"{args.out / 'switch.md'}, {args.out / 'switch.png'}")
    failed = [p for p in points if p.status == "failed"]
    return 1 if failed else 0


# -- switch latency ----------------------------------------------------------------------------------------

async def _switch_latency(args, base: dict[str, str], models: list[BenchModel], prompts: PromptMaker,
                          settings: dict[str, str], log_dir: Path
                          ) -> tuple[list[SwitchProbe], list[FirstActivationProbe], dict[str, ModeResult]]:
    prompt = prompts.prompt(min(args.prompt_tokens, args.max_len // 2))  # B's one token must fit the context
    targets = probe_targets(models)
    probes, firsts = await _probes(args, base, models, targets, prompt, settings.get("DEVICE", "auto"), log_dir)
    fresh = {}
    for b, _, _ in targets:
        log.info("switch: a fresh instance of %s (%s) and transformers", b.name, ", ".join(args.fresh_modes))
        model, fresh_settings = str(b.layout_dir), {**settings, "MODEL": str(b.layout_dir)}
        kinds = [m for m in args.fresh_modes if m != "cold"]
        if kinds:
            model, snapshot_dir = bake_fresh(b, kinds, settings, log_dir)
            fresh_settings = {**settings, "MODEL": model, "SNAPSHOT_DIR": str(snapshot_dir)}
        plan = ColdStartPlan(model=model, modes=tuple(args.fresh_modes) + (BASELINE_MODE,), repeat=1,
                             page_cache="warm", settings=fresh_settings, log_dir=log_dir / f"fresh-{b.name}",
                             prompt_tokens=len(prompt), max_tokens=1, timeout_s=args.timeout,
                             baseline_model=str(b.hf_dir))
        for result in await run_coldstart(plan):
            fresh[f"{b.name}:{result.mode}"] = result
    return probes, firsts, fresh


async def _probes(args, base: dict[str, str], models: list[BenchModel], targets, prompt, device: str,
                  log_dir: Path) -> tuple[list[SwitchProbe], list[FirstActivationProbe]]:
    """Each B's retained and evicted rows from the instance of every model (the evicted one again with
    POOL_EVICTION=lru where the cost model did not reach it), its partial row from instances of its own, and
    the first activations."""
    beside = targets if "beside" in args.first_kernels else []  # each B's first request, before its probes
    everyone = {**base, "MODEL": model_setting(boot_order(models, targets)), "POOL_EVICTION": "cost",
                "POOL_KERNELS": "beside"}
    firsts, shared = await _probe_states(args, everyone, prompt, log_dir / "switch-instance.log",
                                         [(*target, state) for target in targets for state in SHARED_STATES], beside)
    one = {**base, **_one_device(args.gpus, device)}
    firsts += await separate_instances(args, one, targets, prompt, device != "cpu" and gpu_memory_bytes() is not None,
                                       log_dir)
    rows = {(p.model, p.state): p for p in shared}
    for b, _, _ in targets:
        rows[b.name, "partial"] = await probe_partial(one, device, b, filler(b, models), prompt, log_dir, args.timeout)
    unreached = [(b, a, others) for b, a, others in targets if rows[b.name, "evicted"].status != "ok"]
    if unreached:  # whole-model eviction drops B entirely: the reload of all its bytes
        _, again = await _probe_states(args, {**base, "POOL_EVICTION": "lru"}, prompt, log_dir / "switch-lru.log",
                                       [(*target, "evicted") for target in unreached])
        for retry in again:
            retry.eviction = "lru"
            if retry.status == "ok":
                rows[retry.model, "evicted"] = retry
    return [rows[b.name, state] for b, _, _ in targets for state in STATES], firsts


async def _probe_states(args, settings: dict[str, str], prompt, log_path: Path,
                        wanted: list[tuple[BenchModel, BenchModel, list[BenchModel], str]], first=()
                        ) -> tuple[list[FirstActivationProbe], list[SwitchProbe]]:
    """One instance with SETTINGS: the first activations of FIRST's Bs (kernels beside the weights), then
    each (B, A, others, state) probed in turn."""
    async def work(target) -> tuple[list[FirstActivationProbe], list[SwitchProbe]]:
        firsts = await first_activations(target, list(first), "beside")
        probes = []
        for b, a, others, state in wanted:
            log.info("switch: probing %s %s (A = %s, eviction %s)", b.name, state, a.name, settings["POOL_EVICTION"])
            result = await probe(target, b, a, others, state)
            result.eviction = settings["POOL_EVICTION"]
            probes.append(result)
        return firsts, probes

    return await in_instance("cold", settings, prompt, log_path, args.timeout, work)


def bake_fresh(model: BenchModel, kinds: list[str], settings: dict[str, str], log_dir: Path) -> tuple[str, Path]:
    """The snapshots of KINDS for B's layout, for its fresh instance on those restore paths (faas-build's bake,
    runtime/bench/fresh_snapshots.py); returns (the layout, the snapshot directory). Baked afresh each run: a
    snapshot's fingerprint covers this checkout and its settings."""
    snapshots = model.layout_dir.with_name(f"{model.layout_dir.name}-snapshots")
    shutil.rmtree(snapshots, ignore_errors=True)
    log_path = log_dir / f"bake-{model.name}.log"
    log_path.parent.mkdir(parents=True, exist_ok=True)
    log.info("switch: baking %s's %s snapshots (log: %s)", model.name, ",".join(kinds), log_path)
    with open(log_path, "wb") as out:
        done = subprocess.run([sys.executable, "-m", "runtime.bench.fresh_snapshots", str(model.layout_dir),
                               str(snapshots), ",".join(kinds)], cwd=SOURCE_ROOT,
                              env=child_environment(settings, 0.0), stdout=out, stderr=subprocess.STDOUT)
    if done.returncode != 0:
        raise BenchError(f"baking {model.name}'s snapshots failed (log: {log_path})")
    return str(model.layout_dir), snapshots


def _fastest_s(result: ModeResult) -> float | None:
    return min((r.spawn_to_first_token_s for r in result.runs), default=None)


def probe_table(probes: list[SwitchProbe], fresh: dict[str, ModeResult]) -> str:
    head = ["B", "state", "retained", "B's first token (s)", "B active (s)", "switch (s)", "evict (s)", "map (s)",
            "stream (s)", "loaded (MiB)", "GiB/s", "fresh instance (s)", "transformers (s)"]
    rows = ["| " + " | ".join(head) + " |", "|" + " --- |" * len(head)]
    for p in probes:
        fastest = [(k.split(":", 1)[1], _fastest_s(r)) for k, r in fresh.items()
                   if k.startswith(f"{p.model}:") and r.status == "ok" and not k.endswith(BASELINE_MODE)]
        fastest = [(mode, s) for mode, s in fastest if s is not None]
        best = min(fastest, key=lambda item: item[1]) if fastest else None
        hf = fresh.get(f"{p.model}:{BASELINE_MODE}")
        hf_s = _fastest_s(hf) if hf and hf.status == "ok" else None
        state = p.state if p.eviction == "cost" else f"{p.state} ({p.eviction})"
        if p.status != "ok":
            cells = [p.model, state, f"skipped: {p.reason}"] + [""] * (len(head) - 3)
        else:
            cells = [p.model, state, f"{p.retained_fraction:.0%}", f"{p.ttft_s:.3f}", f"{p.active_ttft_s:.3f}",
                     _num(p.switch_s), _num(p.evict_s), _num(p.map_s), _num(p.stream_s),
                     f"{p.bytes_loaded / 2**20:.1f}", _num(p.gib_per_s, 1),
                     f"{best[1]:.3f} ({best[0]})" if best else "-", _num(hf_s)]
        rows.append("| " + " | ".join(c.replace("|", "/") for c in cells) + " |")
    return "\n".join(rows)


# -- the trace ---------------------------------------------------------------------------------------------

async def _trace(args, base: dict[str, str], models: list[BenchModel], prompts: PromptMaker,
                 settings: dict[str, str], pool_bytes: int, log_dir: Path) -> list[SystemPoint]:
    device = settings.get("DEVICE", "auto")
    one = _one_device(args.gpus, device)
    systems = [("pool", {**one, "POOL_EVICTION": "cost"}), ("lru", {**one, "POOL_EVICTION": "lru"})]
    if args.gpus > 1:  # the same memory in all, spread over the devices: what several devices add is the rest
        spread = {**_devices(args.gpus, device), **pool_budget(pool_bytes // args.gpus, device)}
        systems += [(f"pool-{p}", {**spread, "PLACEMENT": p}) for p in POLICIES]
    largest = max(m.nbytes for m in models)
    capacity = max(1, pool_bytes // int(largest * 1.25))  # a model and its KV cache per instance
    per_model = {m.name: {**settings, "MODEL": str(m.layout_dir), **_instance_budget(pool_bytes // capacity, device)}
                 for m in models}
    gpus = tuple(str(i) for i in range(args.gpus)) if device != "cpu" and args.gpus > 1 else ()
    points = []
    for rate in args.rates:
        shape = WorkloadShape(rate, args.duration, args.prompt_mean * args.length_scale,
                              args.output_mean * args.length_scale, args.max_len, args.seed)
        workload = make_workload(shape)
        picks = zipf_models(models, len(workload), args.zipf, args.seed)
        for system, extra in systems:
            log.info("trace: %s at %g requests/s, %d requests over %g s", system, rate, len(workload), args.duration)
            points.append(await run_pool(system, rate, workload, picks, prompts, {**base, **extra}, log_dir,
                                         args.timeout))
        log.info("trace: per-model (at most %d instances) at %g requests/s", capacity, rate)
        points.append(await run_per_model(rate, workload, picks, prompts, per_model, capacity, args.idle_timeout,
                                          log_dir, args.timeout, gpus))
    return points


def _devices(n: int, device: str) -> dict[str, str]:
    """The settings of an instance pooling N devices: the first N GPUs, or N simulated ones on cpu."""
    if device == "cpu":
        return {"POOL_CPU_DEVICES": str(n)}
    return {"CUDA_VISIBLE_DEVICES": ",".join(str(i) for i in range(n))}


def _one_device(n: int, device: str) -> dict[str, str]:
    """The settings that keep an instance on one device of a machine with N (a pool takes every GPU it sees)."""
    return {"CUDA_VISIBLE_DEVICES": "0"} if device != "cpu" and n > 1 else {}


def _instance_budget(nbytes: int, device: str) -> dict[str, str]:
    budget = pool_budget(nbytes, device)
    return {"GPU_MEMORY_UTILIZATION": budget["GPU_MEMORY_UTILIZATION"]} if "GPU_MEMORY_UTILIZATION" in budget else {}


def trace_table(points: list[SystemPoint]) -> str:
    head = ["system", "rate (req/s)", "requests", "completed", "TTFT p50 (s)", "TTFT p99 (s)", "switches / starts",
            "streamed (GiB)"]
    rows = ["| " + " | ".join(head) + " |", "|" + " --- |" * len(head)]
    for p in points:
        if p.status != "ok":
            cells = [p.system, f"{p.rate:g}", str(p.requests), f"{p.status}: {p.reason}"] + [""] * 4
        else:
            cells = [p.system, f"{p.rate:g}", str(p.requests), str(p.completed), f"{p.ttft_p50_s:.3f}",
                     f"{p.ttft_p99_s:.3f}", str(p.switches), f"{p.bytes_streamed / GiB:.2f}"]
        rows.append("| " + " | ".join(c.replace("|", "/") for c in cells) + " |")
    return "\n".join(rows + _device_rows(points))


def _device_rows(points: list[SystemPoint]) -> list[str]:
    """Per device of each pooled system that ran on several: streamed bytes, switches, the most its pool and
    (on a GPU) the GPU held."""
    several = [p for p in points if p.status == "ok" and len(p.devices) > 1]
    if not several:
        return []
    head = ["system", "rate (req/s)", "device", "switches", "streamed (GiB)", "pool peak (GiB)",
            "GPU memory peak (GiB)"]
    rows = ["", "| " + " | ".join(head) + " |", "|" + " --- |" * len(head)]
    for p in several:
        for device, u in sorted(p.devices.items()):
            gpu = "-" if u.gpu_memory_peak_bytes is None else f"{u.gpu_memory_peak_bytes / GiB:.2f}"
            rows.append(f"| {p.system} | {p.rate:g} | {device} | {u.switches} | {u.bytes_streamed / GiB:.2f} | "
                        f"{u.pool_used_peak_bytes / GiB:.2f} | {gpu} |")
    return rows


def _num(value: float | None, digits: int = 3) -> str:
    return "-" if value is None else f"{value:.{digits}f}"
