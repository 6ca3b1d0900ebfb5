"""`faas-bench switch`'s first activations: B's first request in a several-model instance, with A active. It
starts B's engine (docs/multi-model.md): B's weights stream in and its kernels are loaded

- `beside` the stream, its decode graphs captured while the weights arrive (POOL_KERNELS=beside);
- `after` it, as a lone model's cold start does (POOL_KERNELS=after, the default);
- or its graphs `restored` from the pooled materialized profile faas-build bakes (SNAPSHOT_DIR; a GPU only).

Each is timed to B's first token, beside B's next request (B active), with what /health's `first_start`
says that start spent. `beside` runs in the switch probes' instance, before any of its other requests for
B; `after` and `restored` each in an instance of their own that serves only the probes' models."""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from runtime.bench.client import Prompt
from runtime.bench.instance import SOURCE_ROOT, child_environment
from runtime.bench.records import FIRST_KERNELS
from runtime.bench.switch import InstanceProbe, in_instance
from runtime.bench.switch_models import BenchModel
from runtime.logs import get_logger

log = get_logger("bench")

Target = tuple[BenchModel, BenchModel, list[BenchModel]]  # B, A, the others (switch.probe_targets)


@dataclass
class FirstActivationProbe:
    model: str  # B, never requested before in its instance
    shape: str
    previous: str  # A, served just before B's request (its engine started)
    kernels: str  # beside, after or restored
    status: str = "ok"  # or "skipped"
    reason: str | None = None
    ttft_s: float | None = None  # B's first request, sent -> first token: its engine's start included
    active_ttft_s: float | None = None  # B's next request, B active: no start, no switch
    # /health first_start of B: the whole start, the weight stream, the graphs (captured or restored),
    # kernel loading and what of it the start waited for, the Triton specialisations loaded
    total_s: float | None = None
    stream_s: float | None = None
    graphs_s: float | None = None
    graphs_restored: bool | None = None
    kernels_s: float | None = None
    kernels_critical_s: float | None = None
    kernels_loaded: int | None = None


_FIRST_START = ("total_s", "stream_s", "graphs_s", "graphs_restored", "kernels_s", "kernels_critical_s",
                "kernels_loaded")  # the fields of /health's first_start


async def first_activation(instance: InstanceProbe, b: BenchModel, a: BenchModel, kernels: str) -> FirstActivationProbe:
    result = FirstActivationProbe(b.name, b.shape, a.name, kernels)
    if await instance.first_start(b.name) is not None:
        result.status, result.reason = "skipped", f"{b.name}'s engine started before its first request"
        return result
    await instance.request(a.name)  # A active (and started, if it was not the model started at boot)
    result.ttft_s = round(await instance.request(b.name), 6)
    result.active_ttft_s = round(await instance.request(b.name), 6)
    first = await instance.first_start(b.name)
    for name in _FIRST_START:
        setattr(result, name, first[name])
    log.info("switch: %s's first activation (kernels %s): first token %.3f s after its request (%.3f s active), "
             "start %.3f s (weights %.3f s, graphs %.3f s, kernels waited %.3f s, %d loaded)", b.name, kernels,
             result.ttft_s, result.active_ttft_s, result.total_s, result.stream_s, result.graphs_s,
             result.kernels_critical_s, result.kernels_loaded)
    return result


async def first_activations(instance: InstanceProbe, targets: list[Target], kernels: str) -> list[FirstActivationProbe]:
    return [await first_activation(instance, b, a, kernels) for b, a, _ in targets]


def boot_order(models: list[BenchModel], targets: list[Target]) -> list[BenchModel]:
    """MODELS with one that is no probe's B first: an instance starts its first model at boot."""
    bs = {b.name for b, _, _ in targets}
    return sorted(models, key=lambda m: m.name in bs)


def model_setting(models: list[BenchModel]) -> str:
    return ",".join(f"{m.name}={m.layout_dir}" for m in models)


async def separate_instances(args: argparse.Namespace, settings: dict[str, str], targets: list[Target],
                             prompt: Prompt, on_gpu: bool, log_dir: Path) -> list[FirstActivationProbe]:
    """The `after` and `restored` rows that args.first_kernels asks for, each kind in its own instance of
    SETTINGS serving the probes' models only."""
    needed = {m.name: m for b, a, _ in targets for m in (b, a)}
    settings = {**settings, "MODEL": model_setting(boot_order(list(needed.values()), targets)), "POOL_EVICTION": "cost"}
    rows = []
    if "after" in args.first_kernels:
        log.info("switch: first activations with POOL_KERNELS=after")
        rows += await in_instance("cold", {**settings, "POOL_KERNELS": "after"}, prompt, log_dir / "first-after.log",
                                  args.timeout, lambda instance: first_activations(instance, targets, "after"))
    if "restored" in args.first_kernels:
        rows += await _restored(args, settings, targets, prompt, on_gpu, log_dir)
    return rows


async def _restored(args, settings: dict[str, str], targets: list[Target], prompt: Prompt, on_gpu: bool,
                    log_dir: Path) -> list[FirstActivationProbe]:
    def skipped(why: str) -> list[FirstActivationProbe]:
        return [FirstActivationProbe(b.name, b.shape, a.name, "restored", "skipped", why) for b, a, _ in targets]

    if not on_gpu:
        return skipped("materialized snapshots need a GPU (the instance runs on the host)")
    snapshots = args.out / "pooled-snapshots"
    failed = bake_pooled([b.name for b, _, _ in targets], settings, snapshots, log_dir / "bake-pooled.log")
    if failed:
        return skipped(failed)
    log.info("switch: first activations with the baked graphs of %s", ", ".join(b.name for b, _, _ in targets))
    rows, health = await in_instance("materialized", {**settings, "SNAPSHOT_DIR": str(snapshots)}, prompt,
                                     log_dir / "first-restored.log", args.timeout,
                                     lambda instance: _rows_and_health(instance, targets))
    unbaked = health.get("skipped", {}).get("materialized", "")  # "name: why; name: why"
    for row in rows:
        if row.status == "ok" and not row.graphs_restored:  # measured, but on another path than the row's
            why = next((part for part in unbaked.split("; ") if part.startswith(f"{row.model}: ")), unbaked)
            row.status, row.reason = "skipped", f"graphs not restored: {why or 'no reason given'}"
    return rows


async def _rows_and_health(instance: InstanceProbe, targets: list[Target]) -> tuple[list[FirstActivationProbe], dict]:
    return await first_activations(instance, targets, "restored"), await instance.health()


def bake_pooled(names: list[str], settings: dict[str, str], snapshots: Path, log_path: Path) -> str | None:
    """NAMES' pooled materialized profiles in SNAPSHOTS/name, for the instance of SETTINGS (its MODEL list,
    pool budget and engine settings); baked afresh each run (a fingerprint covers this checkout). Returns
    why it failed, None when every one was baked."""
    shutil.rmtree(snapshots, ignore_errors=True)
    log_path.parent.mkdir(parents=True, exist_ok=True)
    log.info("switch: baking the pooled graphs of %s (log: %s)", ", ".join(names), log_path)
    with open(log_path, "wb") as out:
        done = subprocess.run([sys.executable, "-m", "runtime.bench.fresh_snapshots", "--pooled", str(snapshots),
                               ",".join(names)], cwd=SOURCE_ROOT, env=child_environment(settings, 0.0),
                              stdout=out, stderr=subprocess.STDOUT)
    if done.returncode == 0:
        return None
    lines = [line for line in log_path.read_text(errors="replace").splitlines() if " materialized " in line]
    return f"baking the pooled graphs failed: {lines[-1] if lines else f'exit {done.returncode}'} (log: {log_path})"


def first_table(rows: list[FirstActivationProbe]) -> str:
    head = ["B", "kernels", "B's first token (s)", "active (s)", "first start (s)", "weights (s)", "graphs (s)",
            "kernels waited (s)", "kernels loaded"]
    lines = ["| " + " | ".join(head) + " |", "|" + " --- |" * len(head)]
    models = list(dict.fromkeys(r.model for r in rows))
    for r in sorted(rows, key=lambda r: (models.index(r.model), FIRST_KERNELS.index(r.kernels))):
        if r.status != "ok":
            cells = [r.model, r.kernels, f"skipped: {r.reason}"] + [""] * (len(head) - 3)
        else:
            cells = [r.model, r.kernels] + [f"{v:.3f}" for v in (r.ttft_s, r.active_ttft_s, r.total_s, r.stream_s,
                                                                 r.graphs_s, r.kernels_critical_s)]
            cells.append(str(r.kernels_loaded))
        lines.append("| " + " | ".join(c.replace("|", "/") for c in cells) + " |")
    return "\n".join(lines)
