"""`faas-bench switch`'s partial state: B partly retained when its request arrives, reached in an instance of
its own that serves B and a filler model F, its pool budget computed so that making F resident must evict part
of B, not all of it.

Among many models the cost model may never evict part of B: it keeps the groups of the model asked for most,
and B has just served requests. With B the only other model in the pool, it frees what the pool is short of,
about that many bytes of B's (its idle KV cache past the first chunk first, then what the cost model picks
of its groups and that chunk). So:

1. a sizing instance with room for both serves B twice, then F, and /health says what its pool holds with both
   resident (`budget_bytes - free_bytes`: weights, KV caches, the engines' own buffers) and B's KV cache;
2. the partial instance's budget is that, less B's KV cache, less half the smaller of B's and F's weights: the
   part of B that F's activation must evict (B must still fit beside what F keeps when B comes back);
3. it serves the same requests, B twice (the second is `active_ttft_s`) and F; B's share of the pool is read
   from /health, and B's request is timed as the other probes time theirs (switch.measure).

Both instances boot F (an instance starts its first model at boot) and serve the same requests, so everything
but B's evicted groups takes the same memory in both. The fraction reached is measured, not assumed: a pool
that did not end up holding part of B (B's weights one group, say) makes the row skipped, saying so.
"""

from __future__ import annotations

from pathlib import Path

from runtime.bench import BenchError
from runtime.bench.client import Prompt
from runtime.bench.instance import InstanceFailed
from runtime.bench.switch import InstanceProbe, SwitchProbe, classify, in_instance, measure
from runtime.bench.switch_budget import GiB, budget_like, roomy_budget
from runtime.bench.switch_first import model_setting
from runtime.bench.switch_models import BenchModel
from runtime.logs import get_logger

log = get_logger("bench")


class PartialUnreachable(BenchError):
    """The sizing instance did not give what the partial instance's budget is computed from."""


def filler(b: BenchModel, models: list[BenchModel]) -> BenchModel:
    """F: the smallest other model at least as large as B (its activation can evict half of B), else the
    largest other."""
    rest = [m for m in models if m is not b]
    if not rest:
        raise BenchError("the switch benchmark needs at least two models")
    larger = [m for m in rest if m.nbytes >= b.nbytes]
    return min(larger, key=lambda m: m.nbytes) if larger else max(rest, key=lambda m: m.nbytes)


async def serve_pair(instance: InstanceProbe, b: BenchModel, f: BenchModel) -> float:
    """B twice, then F (F active); returns the TTFT of B's second request (B active)."""
    await instance.request(b.name)
    active = await instance.request(b.name)
    await instance.request(f.name)
    return active


def partial_budget(pool: dict, b: str, f: str) -> int:
    """The budget of a pool in which F's activation evicts part of B, from /health's pool of the sizing
    instance (both resident)."""
    mb, mf = pool["models"][b], pool["models"][f]
    for name, m in ((b, mb), (f, mf)):
        if m["resident_bytes"] < m["total_bytes"]:
            raise PartialUnreachable(f"the sizing pool of {pool['budget_bytes'] / GiB:.2f} GiB did not keep all of "
                                     f"{name} ({m['resident_bytes'] / m['total_bytes']:.0%})")
    used = pool["budget_bytes"] - pool["free_bytes"]
    return used - mb["kv_bytes"] - min(mb["total_bytes"], mf["total_bytes"]) // 2


async def size_partial(settings: dict[str, str], device: str, b: BenchModel, f: BenchModel, prompt: Prompt,
                       log_dir: Path, timeout_s: float) -> tuple[dict[str, str], int]:
    """The partial instance's settings (SETTINGS serving F and B, with the computed budget) and that budget.
    Raises PartialUnreachable."""
    pair = {**settings, "MODEL": model_setting([f, b]), "POOL_EVICTION": "cost"}
    roomy = roomy_budget(2 * (b.nbytes + f.nbytes) + GiB, device)

    async def size(instance: InstanceProbe) -> dict:
        await serve_pair(instance, b, f)
        return await instance.pool_of(b.name)

    log.info("switch: sizing a pool of %s and %s for the partial state", b.name, f.name)
    pool = await in_instance("cold", {**pair, **roomy}, prompt, log_dir / f"partial-{b.name}-sizing.log",
                             timeout_s, size)
    budget = partial_budget(pool, b.name, f.name)
    log.info("switch: both held %.1f MiB of the pool (%s's KV cache %.1f MiB): a pool of %.1f MiB for the partial "
             "state", (pool["budget_bytes"] - pool["free_bytes"]) / 2**20, b.name,
             pool["models"][b.name]["kv_bytes"] / 2**20, budget / 2**20)
    try:
        return {**pair, **budget_like(roomy, pool["budget_bytes"], budget)}, budget
    except BenchError as exc:
        raise PartialUnreachable(str(exc)) from None


async def reach_partial(instance: InstanceProbe, b: BenchModel, f: BenchModel) -> tuple[SwitchProbe, dict]:
    """In the partial instance: the requests that leave part of B, F active. Returns B's row so far (skipped
    if B is not partly retained) and B's pool entry."""
    result = SwitchProbe(b.name, b.shape, f.name, "partial")
    result.active_ttft_s = round(await serve_pair(instance, b, f), 6)
    pool = await instance.pool_of(b.name)
    entry = pool["models"][b.name]
    fraction = entry["resident_bytes"] / entry["total_bytes"]
    result.retained_fraction = round(fraction, 4)
    if classify(fraction) != "partial":
        result.status, result.reason = "skipped", (
            f"{b.name} was {classify(fraction)} ({fraction:.0%} retained) after {f.name} was made resident in a "
            f"pool of {pool['budget_bytes'] / GiB:.2f} GiB computed to evict part of it"
            + (": the pool evicts whole groups (--chunk-mb)" if fraction == 0 else ""))
    return result, entry


async def measure_partial(instance: InstanceProbe, b: BenchModel, f: BenchModel) -> SwitchProbe:
    result, entry = await reach_partial(instance, b, f)
    if result.status != "ok":
        return result
    return await measure(instance, result, result.retained_fraction, entry)


async def probe_partial(settings: dict[str, str], device: str, b: BenchModel, f: BenchModel, prompt: Prompt,
                        log_dir: Path, timeout_s: float) -> SwitchProbe:
    """B's partial row: sized, then measured in the partial instance (both on one device of SETTINGS)."""
    try:
        partial, budget = await size_partial(settings, device, b, f, prompt, log_dir, timeout_s)
    except PartialUnreachable as exc:
        return SwitchProbe(b.name, b.shape, f.name, "partial", status="skipped", reason=str(exc))
    log.info("switch: probing %s partial (A = %s, in an instance of the two)", b.name, f.name)
    try:
        return await in_instance("cold", partial, prompt, log_dir / f"partial-{b.name}.log", timeout_s,
                                 lambda instance: measure_partial(instance, b, f))
    except InstanceFailed as exc:  # a budget the models cannot start in, say: the rest of the bench goes on
        return SwitchProbe(b.name, b.shape, f.name, "partial", status="skipped",
                           reason=f"the instance with the computed pool of {budget / GiB:.2f} GiB: {exc}")
