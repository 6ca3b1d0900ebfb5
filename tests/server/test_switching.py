"""A device's switch when the room it needs is held by another model's request in flight: it waits for that
request instead of failing, also when the request finishes just as the pool refuses the switch."""

import asyncio
import time
from types import SimpleNamespace

import pytest
import torch

from runtime.pool.pool import ModelPool
from runtime.server.metrics import ServerMetrics
from runtime.server.switching import DeviceSlot
from runtime.timeline import Timeline
from tests.pool.helpers import PROMPTS, build, greedy, make_layout

A, B = "tiny-llama", "tiny-qwen2"


@pytest.fixture(scope="module")
def layouts(tiny_model, tmp_path_factory):
    root = tmp_path_factory.mktemp("switch-layouts")
    return {name: make_layout(tiny_model(name), root / name) for name in (A, B)}


@pytest.fixture
def slot(layouts):
    sizes = {}
    probe = ModelPool(torch.device("cpu"), 1 << 40)
    for name, layout in layouts.items():
        probe.add(name, build(layout))
    for name, m in probe._models.items():
        sizes[name] = m.total_bytes + m.kv.least_bytes()
    # room for either model and its first sequence, never for both
    pool = ModelPool(torch.device("cpu"), max(sizes.values()) + min(sizes.values()) // 2)
    for name, layout in layouts.items():
        pool.add(name, build(layout))
    state = SimpleNamespace(timeline=Timeline(), model_name=None, restore_path=None, engine=None, models=None,
                            ready=True)
    slot = DeviceSlot("cpu", pool, ServerMetrics(state), state.timeline)
    yield slot
    slot.shutdown()
    pool.shutdown()


def test_a_switch_refused_as_the_holding_request_finishes_is_retried(slot, layouts):
    alone = build(layouts[B])
    alone.start()
    try:
        expected = greedy(alone, PROMPTS[0])
    finally:
        alone.shutdown()

    async def scenario():
        await slot.enter(A)  # A resident, one request in flight: B cannot fit beside it
        switch = asyncio.create_task(slot.enter(B))
        await asyncio.sleep(0)  # B's activation is on the slot's worker thread now
        time.sleep(1.0)  # the event loop is busy: the pool refuses B (A is held) before the loop sees it
        slot.leave(A, 0.1)  # A's request ends: its release is queued behind the refused activation
        await asyncio.wait_for(switch, 30)

    asyncio.run(scenario())
    stats = slot.pool.stats()
    assert stats.models[B].resident_bytes == stats.models[B].total_bytes
    assert stats.models[A].resident_bytes < stats.models[A].total_bytes  # B's switch evicted A
    assert greedy(slot.pool.engine(B), PROMPTS[0]) == expected
    slot.leave(B, 0.1)
