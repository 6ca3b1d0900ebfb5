"""Several tiny models in one pool whose budget cannot hold them all: each activation gives exactly the
model's own output, evicted groups really give their memory back, and only missing groups stream again."""

import time

import pytest
import torch

from runtime.pool.errors import PoolError
from runtime.pool.pool import ModelPool
from tests.pool.helpers import PRESETS, PROMPTS, build, greedy, make_layout


@pytest.fixture(scope="module")
def layouts(tiny_model, tmp_path_factory):
    root = tmp_path_factory.mktemp("pool-layouts")
    return {preset: make_layout(tiny_model(preset), root / preset) for preset in PRESETS}


@pytest.fixture(scope="module")
def alone(layouts):
    """Each model's greedy output, started alone (no pool)."""
    out = {}
    for preset, layout in layouts.items():
        engine = build(layout)
        engine.start()
        try:
            out[preset] = [greedy(engine, p) for p in PROMPTS]
        finally:
            engine.shutdown()
    return out


def needs(layouts) -> dict[str, tuple[int, int]]:
    """Each model's (weight bytes, weights and the KV cache of one sequence) in a pool."""
    probe = ModelPool(torch.device("cpu"), 1 << 40)
    for preset, layout in layouts.items():
        probe.add(preset, build(layout))
    return {name: (m.total_bytes, m.total_bytes + m.kv.least_bytes()) for name, m in probe._models.items()}


@pytest.fixture
def pool(layouts):
    sizes = needs(layouts)
    # every model but not all three: half the smallest model's weights short
    pool = ModelPool(torch.device("cpu"), sum(n for _, n in sizes.values()) - min(w for w, _ in sizes.values()) // 2)
    for preset, layout in layouts.items():
        pool.add(preset, build(layout))
    yield pool
    pool.shutdown()


def run(pool, name):
    report = pool.activate(name)
    pool.hold(name)
    try:
        return report, [greedy(pool.engine(name), p) for p in PROMPTS]
    finally:
        pool.release(name)


def test_turns_give_each_models_own_output_through_eviction_and_reload(pool, alone):
    order = ["tiny-llama", "tiny-qwen2", "tiny-qwen3", "tiny-llama", "tiny-qwen3", "tiny-qwen2", "tiny-llama"]
    reports = []
    for name in order:
        report, outputs = run(pool, name)
        assert outputs == alone[name], name
        reports.append(report)
        stats = pool.stats()
        assert stats.used_bytes <= stats.budget_bytes
        assert stats.models[name].resident_bytes == stats.models[name].total_bytes
    assert [r.first_start for r in reports] == [True] * 3 + [False] * 4
    assert sum(r.bytes_evicted for r in reports) > 0
    reloads = [r for r in reports if not r.first_start and r.bytes_loaded]
    assert reloads, "the budget should have forced a reload"
    # a reload found part of the model still there and streamed only the rest
    assert any(0 < r.bytes_resident for r in reloads)
    stats = pool.stats()
    assert sum(m.loads for m in stats.models.values()) == 3 + len(reloads)


def test_reload_streams_only_the_missing_groups(pool, alone):
    run(pool, "tiny-llama")
    run(pool, "tiny-qwen2")
    m = pool._models["tiny-llama"]
    # give back two of its groups by hand, as an eviction would
    dropped = sorted(m.resident)[1:3]
    expected = sum(m.groups[g].nbytes for g in dropped)
    m.unmap_groups(dropped)
    report, outputs = run(pool, "tiny-llama")
    assert report.bytes_loaded == expected
    assert report.bytes_loaded < m.plan.total_bytes
    assert outputs == alone["tiny-llama"]


def test_eviction_gives_the_pages_back_to_the_os(pool):
    run(pool, "tiny-llama")
    m = pool._models["tiny-llama"]
    address = m.weights.tensor.data_ptr()
    before = mapping_rss(address)
    assert before >= m.plan.total_bytes * 0.9  # the weights were written: their pages are in memory
    freed = m.unmap_groups(sorted(m.resident))
    assert freed == m.total_bytes
    assert mapping_rss(address) <= before - freed * 0.9


def test_a_model_larger_than_the_pool_is_refused_at_add(layouts):
    pool = ModelPool(torch.device("cpu"), 64 << 10)
    with pytest.raises(PoolError, match="needs at least .* the pool holds"):
        pool.add("tiny-llama", build(layouts["tiny-llama"]))
    assert pool.names() == []


def test_unknown_model_and_unbalanced_release_are_clear_errors(pool):
    with pytest.raises(PoolError, match="not in the pool"):
        pool.activate("gpt-5")
    with pytest.raises(PoolError, match="released more often than held"):
        pool.release("tiny-llama")


def mapping_rss(address: int) -> int:
    """Resident bytes of the mapping that holds ADDRESS (/proc/self/smaps)."""
    inside = False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()[0]
            if "-" in head and all(c in "0123456789abcdef-" for c in head):
                start, end = (int(x, 16) for x in head.split("-"))
                inside = start <= address < end
            elif inside and head == "Rss:":
                return int(line.split()[1]) * 1024
    raise AssertionError("no mapping holds the address")


def test_lru_policy_evicts_whole_models(layouts, alone):
    sizes = needs(layouts)
    budget = sum(n for _, n in sizes.values()) - min(w for w, _ in sizes.values()) // 2
    pool = ModelPool(torch.device("cpu"), budget, policy="lru")
    try:
        for preset, layout in layouts.items():
            pool.add(preset, build(layout))
        for name in ["tiny-llama", "tiny-qwen2", "tiny-qwen3"]:
            run(pool, name)
        resident = {n: m.resident_bytes for n, m in pool.stats().models.items()}
        assert resident["tiny-llama"] == 0  # the least recently used went whole, its KV cache with it
        assert pool.stats().models["tiny-llama"].kv_bytes == 0
        report, outputs = run(pool, "tiny-llama")
        assert report.bytes_resident == 0 and report.bytes_loaded > 0
        assert outputs == alone["tiny-llama"]
    finally:
        pool.shutdown()


def test_an_unknown_policy_is_refused():
    with pytest.raises(PoolError, match="eviction policy 'mru'"):
        ModelPool(torch.device("cpu"), 1 << 30, policy="mru")


class PiecesOnTheWeights:
    """The graph work left for after ready, as a materialised restore does it on a GPU: pieces that each read
    the model's memory (there, by running its first layers: weights and KV block 0). Each piece notes whether
    the model's memory was all there when it began."""

    before_weights = False

    def __init__(self, pool: ModelPool, name: str, pieces: int) -> None:
        self.pool, self.name, self.pieces = pool, name, pieces
        self.timings: dict[str, float] = {}
        self.pending_timings: dict[str, float] = {}
        self.pending = [2]
        self.began_without_memory = 0
        self.done = 0

    def read_ahead(self) -> None:
        pass

    def restore_pending(self, runner, step_aside) -> dict:
        for _ in range(self.pieces):
            step_aside()
            m = self.pool._models[self.name]  # no lock: an eviction holds the pool's while it waits for a piece
            if len(m.resident) < len(m.groups) or not m.kv.mapped_chunks:
                self.began_without_memory += 1
            sum(float(p.float().sum()) for p in runner.model.parameters())
            time.sleep(0.01)
            self.done += 1
        self.pending = []
        return {}


def evicted_mid_graph_work(layouts, alone) -> tuple[ModelPool, object, PiecesOnTheWeights]:
    """A pool of A (with graph work left for after ready) and B, short of half a model: A served, its graph work
    begun, then B's activation took A's KV cache and part of its weights."""
    a, b = "tiny-llama", "tiny-qwen2"
    sizes = needs({name: layouts[name] for name in (a, b)})
    pool = ModelPool(torch.device("cpu"), sum(n for _, n in sizes.values()) - min(w for w, _ in sizes.values()) // 2)
    pool.add(b, build(layouts[b]))
    engine_a, work = build(layouts[a]), PiecesOnTheWeights(pool, a, pieces=40)
    pool.add(a, engine_a, graph_restorer=work)
    assert run(pool, a)[1] == alone[a]  # A served: its graph work starts, a piece every ~10 ms
    deadline = time.monotonic() + 10
    while not work.done and time.monotonic() < deadline:
        time.sleep(0.001)
    assert 0 < work.done < work.pieces
    report, outputs = run(pool, b)
    assert report.evicted.get("tiny-llama") and outputs == alone[b]
    return pool, engine_a, work


def test_an_eviction_pauses_the_models_graph_work_until_it_is_back(layouts, alone):
    pool, engine_a, work = evicted_mid_graph_work(layouts, alone)
    try:
        paused_at = work.done
        time.sleep(0.2)
        assert work.done == paused_at  # no piece while A's memory is gone
        assert run(pool, "tiny-llama")[1] == alone["tiny-llama"]
        assert engine_a.wait_for_graphs(timeout=10)
        assert work.done == work.pieces and work.began_without_memory == 0
    finally:
        pool.shutdown()


def test_a_shutdown_ends_graph_work_waiting_for_its_evicted_model(layouts, alone):
    pool, engine_a, work = evicted_mid_graph_work(layouts, alone)
    started = time.monotonic()
    pool.shutdown()
    assert time.monotonic() - started < 5 and engine_a.wait_for_graphs(timeout=0)  # the paused work gave up
    assert work.done < work.pieces and work.began_without_memory == 0
