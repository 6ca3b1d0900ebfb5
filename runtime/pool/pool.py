"""ModelPool: several models' engines on one device's memory, each made fully resident when it is asked
for, the groups of models without requests in flight retained until the memory is needed.

The pool owns memory, not serving: a server keeps one pool per device, `add`s each model's built engine,
and around every request calls `hold` (its memory is never evicted while any request is in flight),
`activate` (blocking, from a worker thread: returns once every weight of the model is in place), then
`release`. `note_request` feeds the request rates of the eviction cost model (runtime/pool/eviction.py).
How a switch proceeds and why is in docs/multi-model.md.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from dataclasses import dataclass, field
from typing import Callable

import torch

from runtime import timeline as stages
from runtime.cuda_driver.device import use_device
from runtime.engine.kernels.loaded import loaded_specialisations
from runtime.engine.vmm import SpareMemory
from runtime.logs import get_logger
from runtime.pool.backing import make_backing
from runtime.pool.errors import PoolError
from runtime.pool.eviction import Item, evict_by_cost, group_value, lru_whole_models
from runtime.pool.kv import KVMemory
from runtime.pool.model_memory import ModelMemory

log = get_logger("pool")

POLICIES = ("cost", "lru")
KV_CHUNK = -1  # the Item group that stands for a model's first KV chunk
_RELEASE_MARGIN = 1 << 30  # free device memory beyond a step's activations for spares to be released later


@dataclass
class SwitchReport:
    """What one `activate` did."""

    model: str
    first_start: bool  # the engine was started (device phase) by this activation
    bytes_loaded: int  # weight bytes streamed
    bytes_resident: int  # weight bytes that were already in place
    bytes_evicted: int  # given back by other models (weights and idle KV caches)
    evicted: dict[str, int] = field(default_factory=dict)  # model -> bytes it gave back
    # the parts of total_s spent on memory: making room (waiting for the accounting lock, giving back other
    # models' idle KV caches and the groups eviction chose, and after the stream, releasing what of that the
    # model did not map again), backing the model's missing groups and its first KV chunk, streaming the
    # missing groups in verified (a first start: its weights stage)
    evict_s: float = 0.0
    map_s: float = 0.0
    stream_s: float = 0.0
    kernels_s: float = 0.0  # loading kernel modules (first start on CUDA)
    kernels_critical_s: float = 0.0  # of that, what the switch waited for
    graphs_s: float = 0.0  # capturing or restoring CUDA graphs (first start)
    graphs_restored: bool = False  # from a baked profile, with no capture (first start)
    kernels_loaded: int = 0  # Triton specialisations this process loaded for it (first start)
    total_s: float = 0.0


@dataclass(frozen=True)
class ModelStats:
    resident_bytes: int  # weight bytes in memory
    retained_bytes: int  # of those, kept while the model has no request in flight
    total_bytes: int  # weight bytes when fully resident
    kv_bytes: int
    held: int  # requests in flight
    loads: int
    switches: int
    switch_seconds: tuple[float, ...]  # every activation that loaded bytes, for a histogram
    first_start: SwitchReport | None  # what the activation that started its engine did
    last_switch: SwitchReport | None  # what the last activation that loaded bytes did

    @property
    def last_switch_s(self) -> float:
        return self.last_switch.total_s if self.last_switch is not None else 0.0


@dataclass(frozen=True)
class PoolStats:
    device: str
    budget_bytes: int
    used_bytes: int
    free_bytes: int
    models: dict[str, ModelStats]


class ModelPool:
    def __init__(self, device: torch.device, budget_bytes: int, policy: str = "cost",
                 proactive_kernels: bool = False, capture_graphs: bool = True) -> None:
        """One per device. BUDGET_BYTES: what every model's weights, KV caches and engine buffers on the
        device may take together (device_budget() derives it from the settings). POLICY: cost (Tangram's
        cost model) or lru (whole models, least recently used first: the comparison). PROACTIVE_KERNELS: a
        model's first activation without a baked graph profile captures its CUDA graphs (loading their
        kernels) while its weights stream; off (POOL_KERNELS=after, the default): after, as a single model's
        cold start does. CAPTURE_GRAPHS
        False: a first activation without a graph profile makes no graphs (faas-build captures and
        materialises them itself, snapshots/materialized.py)."""
        if policy not in POLICIES:
            raise PoolError(f"eviction policy {policy!r}: choose one of {', '.join(POLICIES)}")
        self.device = torch.device(device)
        self.budget_bytes = int(budget_bytes)
        self.policy = policy
        self.proactive_kernels = proactive_kernels
        self.capture_graphs = capture_graphs
        self._models: dict[str, ModelMemory] = {}
        self._engines: dict = {}
        self._graph_restorers: dict = {}
        self._lock = threading.Lock()  # the accounting: short critical sections
        self._switching = threading.Lock()  # one activation at a time: they share the device's bandwidth
        self._last_active: str | None = None
        self._granule = _granule(self.device)
        # an eviction's physical memory, until the incoming model has mapped what it needs (CUDA)
        self._spares = SpareMemory(self.device) if self.device.type == "cuda" else None
        self._headroom = 0
        # what torch's allocator held when the pool was made is outside its budget already (device_budget
        # takes the device's used memory off); only what it holds beyond that is charged to the pool
        self._torch_base = torch.cuda.memory_reserved(self.device) if self.device.type == "cuda" else 0

    # -- models ------------------------------------------------------------------------------------

    def add(self, name: str, engine, graph_restorer=None) -> None:
        """A built engine (Engine.build: CPU phase done, not started). Its device phase runs on its first
        `activate`. Raises PoolError if the model can never fit in the pool."""
        if name in self._models:
            raise PoolError(f"model {name!r} is already in the pool")
        loader = engine.weights_loader
        manifest = getattr(loader, "manifest", None)
        spans = None
        if manifest is not None and hasattr(loader, "layout_dir"):
            from runtime.weights.loader import layout_chunks

            spans = [(c.buffer_offset, c.length) for c in layout_chunks(manifest)]
        memory = ModelMemory(name, engine.plan, spans, self.device, self._granule, KVMemory(engine, self._granule))
        least = memory.total_bytes + memory.kv.least_bytes()
        if least > self.budget_bytes:
            raise PoolError(f"model {name!r} needs at least {_gib(least)} (weights and the KV cache of one "
                            f"{engine.max_model_len}-token sequence), the pool holds {_gib(self.budget_bytes)}")
        with self._lock:
            self._models[name] = memory
            self._engines[name] = engine
            self._graph_restorers[name] = graph_restorer

    def names(self) -> list[str]:
        return list(self._models)

    def engine(self, name: str):
        return self._engines[self._model(name).name]

    def hold(self, name: str) -> None:
        """A request of NAME is in flight: none of its memory is evicted until the matching release."""
        with self._lock:
            self._model(name).held += 1

    def release(self, name: str) -> None:
        with self._lock:
            m = self._model(name)
            if m.held <= 0:
                raise PoolError(f"model {name!r} released more often than held")
            m.held -= 1

    def back_kv_blocks(self, name: str, blocks: int) -> int:
        """Back at least the first BLOCKS of NAME's KV cache, as far as the pool has room; returns the blocks
        backed (the bake's graph probe writes to blocks past the first chunk)."""
        m = self._model(name)
        return self.grant_kv(m, 0, blocks)

    def note_request(self, name: str, now: float | None = None) -> None:
        """A request for NAME arrived at NOW (time.time(); default: now). Its rate weighs the value of keeping
        the model's groups."""
        with self._lock:
            self._model(name).note_request(now)

    # -- activation --------------------------------------------------------------------------------

    def activate(self, name: str) -> SwitchReport:
        """Make NAME fully resident (starting its engine on the first call), evicting retained groups of
        models without requests in flight when the pool is short. Blocking; raises PoolError if it cannot
        fit now (other models' requests hold the memory)."""
        with self._switching:
            use_device(self.device)  # this thread's work for the pool (start, loads, unmaps) is on its GPU
            began = time.perf_counter()
            m = self._model(name)
            first = not m.started
            with self._lock:
                m.held += 1  # its own memory is not a candidate while it loads
            try:
                report = self._start(m) if first else self._reload(m)
                # what of the evicted memory M's mappings did not take: after its stream (released before it
                # or beside it, an 8B's 15 GiB slowed a Qwen2-1.5B's stream by a sixth and a third on the H100)
                report.evict_s += self._release_spares(later=True)
                self._engines[name].graph_gate.release()  # its graph work may touch its memory again
            except BaseException:
                self._release_spares()
                raise
            finally:
                with self._lock:
                    m.held -= 1
            report.total_s = time.perf_counter() - began
            with self._lock:
                m.last_used = time.monotonic()
                if self._last_active not in (None, name):
                    m.counters.switches += 1
                self._last_active = name
                if report.bytes_loaded:
                    m.counters.loads += 1
                    m.counters.bytes_loaded += report.bytes_loaded
                    m.counters.last_switch = report
                    m.counters.switch_seconds.append(report.total_s)
            return report

    def _reload(self, m: ModelMemory) -> SwitchReport:
        missing = m.missing()
        resident = m.resident_bytes
        report = SwitchReport(m.name, False, 0, resident, 0)
        first_kv = m.kv.chunk_bytes if not m.kv.mapped_chunks else 0

        def back() -> None:
            m.kv.map_chunks(1)
            if missing:
                m.map_groups(missing)

        self._make_room(m.total_bytes - resident + first_kv, m, report, back)
        if missing:
            t = time.perf_counter()
            report.bytes_loaded = self._stream(m, missing)
            report.stream_s = time.perf_counter() - t
            m.load_bytes_per_s = report.bytes_loaded / max(report.stream_s, 1e-9)
        return report

    def _stream(self, m: ModelMemory, groups: list[int]) -> int:
        """Stream GROUPS back in, verified; returns the bytes streamed."""
        engine = self._engines[m.name]
        chunks = m.chunks_of(groups)
        try:
            if chunks:
                load = engine.weights_loader(engine.plan, engine.runner.weight_buffer, only=chunks)
            else:  # no layout: the loader can only fill the whole buffer (every segment is mapped)
                load = engine.weights_loader(engine.plan, engine.runner.weight_buffer)
            load.wait()
            return getattr(load, "bytes", engine.plan.total_bytes)
        except BaseException:
            with self._lock:  # what did not arrive verified must not be taken for resident
                m.unmap_groups(groups)
            raise

    def _start(self, m: ModelMemory) -> SwitchReport:
        engine = self._engines[m.name]
        report = SwitchReport(m.name, True, 0, 0, 0)
        kv_blocks = m.kv.size()

        def back() -> None:
            m.ensure_backing(self._spares)
            m.map_groups(list(range(len(m.groups))))
            if m.kv.backing is None:
                m.kv.backing = make_backing(kv_blocks * m.kv.block_bytes, m.device, self._spares)
            m.kv.map_chunks(1)

        self._make_room(m.total_bytes + m.kv.chunk_bytes, m, report, back)
        provider = _Provider(self, m)
        restorer = self._graph_restorers[m.name]
        # the KV cache first, the graphs restored or captured beside the weight stream; or the cold order:
        # weights, then the KV cache, then graphs captured
        beside = restorer is not None or self.proactive_kernels
        kernels_before, began = loaded_specialisations(), time.time()
        if not beside:
            engine.config = dataclasses.replace(engine.config, num_kv_blocks=kv_blocks)
        try:
            engine.start(kv_blocks=kv_blocks if beside else None, graph_restorer=restorer, memory=provider,
                         capture_graphs=self.capture_graphs)
        except BaseException:
            with self._lock:
                m.unmap_groups(list(range(len(m.groups))))
                if m.kv.backing is not None:
                    m.kv.unmap_from(0)
            raise
        with self._lock:
            m.started = True
            m.fixed_bytes = provider.other_bytes(engine)
            self._headroom = max(self._headroom, activation_bytes(engine))
        self._kernel_times(engine, report, restorer is not None, beside, began)
        report.kernels_loaded = loaded_specialisations() - kernels_before
        report.bytes_loaded = m.resident_bytes
        m.load_bytes_per_s = engine.plan.total_bytes / max(report.stream_s, 1e-9)
        m.first_start = report
        return report

    @staticmethod
    def _kernel_times(engine, report: SwitchReport, restored: bool, beside: bool, began: float) -> None:
        """The first start's weight, graph and kernel seconds, from the stages its start recorded (the models
        of an instance share one timeline: the stages before BEGAN are other models')."""
        weights = engine.timeline.latest(stages.WEIGHTS, since=began)
        graphs = engine.timeline.latest(stages.CUDA_GRAPHS, since=began)
        report.stream_s = round(weights.seconds, 6) if weights else 0.0
        report.graphs_s = round(graphs.seconds, 6) if graphs else 0.0
        if graphs is None:
            return
        report.graphs_restored = restored
        if restored:  # a materialised restore loads the graphs' kernels ahead and waits for what is left
            report.kernels_s = graphs.detail.get("early_kernels_s", 0.0)
            report.kernels_critical_s = graphs.detail.get("kernels_wait_s", 0.0)
            return
        # captured live: the capture's warm-up forwards load the kernels. Beside the stream, the start waits
        # only for what the capture takes beyond the reads
        report.kernels_s = report.graphs_s
        reads = max((t["seconds"] for t in weights.detail.get("tiers", {}).values()), default=0.0) if weights else 0.0
        report.kernels_critical_s = max(0.0, report.graphs_s - reads) if beside else report.graphs_s

    # -- memory ------------------------------------------------------------------------------------

    def grant_kv(self, m: ModelMemory, usable: int, wanted: int) -> int:
        """Back more of M's KV cache (its block manager found no free block): at least WANTED blocks past
        the USABLE first ones if the pool has or can free the room, else as many chunks as it can (none: the
        scheduler preempts). Called on the model's engine thread. Returns the first blocks backed now."""
        kv = m.kv
        with self._lock:
            target = min(kv.chunks_for(usable + wanted), kv.num_chunks)
            short = (target - kv.mapped_chunks) * kv.chunk_bytes - self._free()
            if short > 0:
                self._evict(short, m, SwitchReport(m.name, False, 0, 0, 0), strict=False)
            room = max(0, self._free()) // kv.chunk_bytes
            kv.map_chunks(min(target, kv.mapped_chunks + room))
            self._release_spares()
            return max(usable, kv.mapped_chunks * kv.chunk_blocks)

    def _release_spares(self, later: bool = False) -> float:
        """Release the spare memory; returns the seconds it took. LATER: on a thread of its own if the device
        has room for the largest step's activations without it (torch's allocator may need to grow meanwhile;
        a mapping the driver has no memory for waits for the release)."""
        began = time.perf_counter()
        if self._spares is not None:
            if later and torch.cuda.mem_get_info(self.device)[0] >= self._headroom + _RELEASE_MARGIN:
                self._spares.release_later()
            else:
                self._spares.release()
        return time.perf_counter() - began

    def _drop_kv(self, m: ModelMemory, keep: int = 0) -> int:
        """Give back an idle model's KV cache past its first KEEP chunks (every block is free when no request
        is in flight); returns the bytes."""
        if m.kv.mapped_chunks <= keep:
            return 0
        self._engines[m.name].graph_gate.hold()
        self._engines[m.name].blocks.give_back(keep * m.kv.chunk_blocks)
        return m.kv.unmap_from(keep)

    def _make_room(self, need: int, m: ModelMemory, report: SwitchReport, back: Callable[[], None]) -> None:
        """Free NEED bytes for M if the pool is short, then BACK (map M's memory) in the same hold of the
        lock: no other model's KV growth can take the room in between."""
        t = time.perf_counter()
        with self._lock:
            short = need - self._free()
            if short > 0:
                self._evict(short, m, report)
            mapped = time.perf_counter()
            back()
        report.evict_s = mapped - t
        report.map_s = time.perf_counter() - mapped

    def _evict(self, short: int, incoming: ModelMemory, report: SwitchReport, strict: bool = True) -> None:
        """Free at least SHORT bytes from models without requests in flight, or raise PoolError (STRICT;
        else free what can be freed). First the idle KV caches past their first chunk, least recently used
        first: they hold nothing a model needs to run; then what the policy chooses among the weight groups
        and the first KV chunks (a chunk's value is the time to back it again, its one mapping per plane)."""
        idle = sorted((o for o in self._models.values()
                       if o is not incoming and not o.held and _is_idle(self._engines[o.name])),
                      key=lambda o: o.last_used)
        for o in idle:
            if short <= 0:
                return
            freed = self._drop_kv(o, keep=1)
            short -= freed
            self._note_evicted(report, o, freed)
        while short > 0:
            items = self._items(idle)
            if not items and not strict:
                return
            if not items:
                raise PoolError(f"model {incoming.name!r} does not fit now: {_gib(short)} more are needed and the "
                                "rest of the pool belongs to models with requests in flight")
            chosen = (evict_by_cost(items, short) if self.policy == "cost"
                      else lru_whole_models(items, short, {o.name: o.last_used for o in idle}))
            for model in {i.model for i in chosen}:
                o = self._models[model]
                self._engines[model].graph_gate.hold()
                groups = [i.group for i in chosen if i.model == model]
                freed = o.unmap_groups([g for g in groups if g != KV_CHUNK])
                freed += self._drop_kv(o) if KV_CHUNK in groups else 0
                short -= freed
                self._note_evicted(report, o, freed)

    def _items(self, models: list[ModelMemory]) -> list[Item]:
        """Each idle model's resident weight groups and its backed first KV chunk (group KV_CHUNK)."""
        now = time.time()
        items = []
        for o in models:
            share = _group_shares(o)
            rate = o.rate.at(now)
            for g in sorted(o.resident):
                items.append(Item(o.name, g, share[g], group_value(share[g], o.load_bytes_per_s, rate)))
            if o.kv.mapped_chunks:
                items.append(Item(o.name, KV_CHUNK, o.kv.mapped_bytes,
                                  group_value(o.kv.mapped_bytes, o.kv.map_bytes_per_s, rate)))
        return items

    @staticmethod
    def _note_evicted(report: SwitchReport, o: ModelMemory, freed: int) -> None:
        if freed:
            report.evicted[o.name] = report.evicted.get(o.name, 0) + freed
            report.bytes_evicted += freed

    def _free(self) -> int:
        return self.budget_bytes - sum(o.used_bytes() for o in self._models.values()) - self._torch_bytes()

    def _torch_bytes(self) -> int:
        """On CUDA, what torch's allocator holds for every engine (graph pools, decode buffers, activations)
        beyond what it held when the pool was made, and at least room for the largest step's activations: the
        pool cannot see those grow."""
        if self.device.type != "cuda":
            return 0
        return max(torch.cuda.memory_reserved(self.device) - self._torch_base, self._headroom)

    def _model(self, name: str) -> ModelMemory:
        m = self._models.get(name)
        if m is None:
            raise PoolError(f"model {name!r} is not in the pool ({', '.join(self._models) or 'empty'})")
        return m

    # -- reporting and shutdown ---------------------------------------------------------------------

    def stats(self) -> PoolStats:
        with self._lock:
            models = {
                name: ModelStats(m.resident_bytes, m.resident_bytes if not m.held else 0, m.total_bytes,
                                 m.kv.mapped_bytes, m.held, m.counters.loads, m.counters.switches,
                                 tuple(m.counters.switch_seconds), m.first_start, m.counters.last_switch)
                for name, m in self._models.items()}
            used = self.budget_bytes - self._free()
        return PoolStats(str(self.device), self.budget_bytes, used, self.budget_bytes - used, models)

    def shutdown(self) -> None:
        """Stop every started engine and give all the pool's memory back."""
        use_device(self.device)
        self._shutdown()

    def _shutdown(self) -> None:
        for name, m in self._models.items():
            engine = self._engines[name]
            if m.started:
                engine.shutdown()
            for backing in (m.weights, m.kv.backing):
                if backing is not None:
                    backing.close()
            m.weights = m.kv.backing = None
            m.resident.clear()
            m.kv.mapped_chunks = 0
            m.started = False
        self._release_spares()


class _Provider:
    """The engine's MemoryProvider: its weights and KV cache from the pool's backings, KV blocks on
    demand."""

    def __init__(self, pool: ModelPool, m: ModelMemory) -> None:
        self.pool = pool
        self.m = m
        self.provided = 0

    def alloc(self, name: str, nbytes: int) -> torch.Tensor | None:
        m = self.m
        if name == "weights":
            self.provided += nbytes
            return m.weights.tensor[:nbytes]
        if name == "kv_cache":  # made and its first chunk backed before the start (ModelPool._start)
            self.provided += nbytes
            return m.kv.backing.tensor[:nbytes]
        return None

    def kv_capacity(self) -> "_Provider":
        return self

    def grant(self, usable: int, wanted: int) -> int:
        return self.pool.grant_kv(self.m, usable, wanted)

    def other_bytes(self, engine) -> int:
        """What the engine allocated itself (rope table, decode buffers), beside the provided buffers."""
        return engine.runner.allocator.total_bytes - self.provided if engine.runner.device.type == "cpu" else 0


def _group_shares(m: ModelMemory) -> dict[int, int]:
    """Each resident group's share of the mapped bytes (a segment two groups share counts half to each)."""
    share = {g: 0 for g in m.resident}
    for s in m.segments:
        owners = [g for g in s.groups if g in m.resident]
        for g in owners:
            share[g] += s.nbytes // len(owners)
    return share


def _is_idle(engine) -> bool:
    """Nothing scheduled and no step in flight: its memory may go (a request that is held never is)."""
    return not engine.ready or engine.idle


def _granule(device: torch.device) -> int:
    if device.type == "cuda":
        from runtime.cuda_driver import allocation_prop, granularity

        return granularity(allocation_prop(device.index if device.index is not None else torch.cuda.current_device()))
    import mmap

    return mmap.PAGESIZE


def activation_bytes(engine) -> int:
    """A generous bound of the largest step's activations on ENGINE: its widest projections over the most
    tokens a step takes, twice (inputs and outputs live together), and the logits of a full batch."""
    c, config = engine.model_config, engine.config
    itemsize = torch.empty((), dtype=getattr(torch, config.dtype)).element_size()
    tokens = max(config.max_num_batched_tokens, engine.max_model_len)
    widest = 2 * c.intermediate_size + 4 * c.hidden_size + c.q_size + 2 * c.kv_size
    return 2 * tokens * widest * itemsize + 2 * config.max_num_seqs * c.vocab_size * 4


def _gib(n: int) -> str:
    return f"{n / 2**30:.2f} GiB" if n >= 2**28 else f"{n / 2**20:.1f} MiB"


def device_budget(device: torch.device, gpu_memory_utilization: float, pool_memory_gb: float | None) -> int:
    """The pool's budget: on CUDA GPU_MEMORY_UTILIZATION of the device's memory less what is used already
    (the CUDA context, other processes); on the host POOL_MEMORY_GB."""
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        return int(min(total * gpu_memory_utilization - (total - free), free))
    if pool_memory_gb is None:
        raise PoolError("POOL_MEMORY_GB must be set to pool several models on the host")
    return int(pool_memory_gb * 2**30)
