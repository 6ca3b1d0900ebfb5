"""Placement of a model's requests over several devices (runtime/server/routing.py), on recorded device
states: no device needed."""

from __future__ import annotations

import pytest

from runtime.server.routing import DeviceLoad, NoDevice, RoundRobin, choose_affinity, fixed_devices

GiB = 1 << 30
RATE = 10 * GiB  # bytes/s


def load(device: str, held: float, queued_s: float = 0.0, running: bool = False, fits: bool = True,
         model: float = 3.0, free: float = 0.0, used: float = 0.0) -> DeviceLoad:
    return DeviceLoad(device, int(model * GiB), int(held * GiB), queued_s, running, fits, int(free * GiB),
                      int(used * GiB))


def test_affinity_goes_to_the_device_holding_most_of_the_model():
    loads = [load("gpu0", 0.5), load("gpu1", 2.5), load("gpu2", 1.0), load("gpu3", 0.0)]
    assert choose_affinity(loads, [RATE] * 4) == 1


def test_affinity_leaves_the_holding_device_when_its_queue_makes_another_faster():
    # gpu0 holds all 3 GiB but has 0.5 s of work ahead; gpu1 must load 3 GiB at 10 GiB/s: 0.3 s
    assert choose_affinity([load("gpu0", 3.0, queued_s=0.5), load("gpu1", 0.0)], [RATE] * 2) == 1
    # a shorter queue (0.2 s) keeps it on the holding device
    assert choose_affinity([load("gpu0", 3.0, queued_s=0.2), load("gpu1", 0.0)], [RATE] * 2) == 0


def test_affinity_weighs_each_devices_own_load_rate():
    # the same missing bytes: the device that loads faster wins
    loads = [load("gpu0", 1.0), load("gpu1", 1.0)]
    assert choose_affinity(loads, [5 * GiB, 20 * GiB]) == 1


def test_a_device_where_the_model_runs_is_joined_at_no_load_cost():
    loads = [load("gpu0", 3.0), load("gpu1", 3.0, queued_s=0.01, running=True)]
    assert choose_affinity(loads, [RATE] * 2) == 0  # both hold it all: the emptier queue
    loads = [load("gpu0", 2.9), load("gpu1", 3.0, running=True)]
    assert choose_affinity(loads, [RATE] * 2) == 1


def test_ties_go_to_more_held_bytes_then_no_eviction_then_the_emptier_pool_then_the_first_device():
    # equal estimates: gpu1 holds more (its queue costs exactly what gpu0's missing bytes do)
    loads = [load("gpu0", 2.0, queued_s=0.0), load("gpu1", 3.0, queued_s=0.1)]
    assert choose_affinity(loads, [RATE] * 2) == 1
    # 2 GiB missing: gpu0 would evict for it, gpu1 has the room
    assert choose_affinity([load("gpu0", 1.0, free=1.0), load("gpu1", 1.0, free=5.0, used=9.0)], [RATE] * 2) == 1
    # both have the room: the pool holding less of other models, whatever else uses the GPU's memory
    assert choose_affinity([load("gpu0", 0.0, free=20.0, used=3.0), load("gpu1", 0.0, free=10.0)], [RATE] * 2) == 1
    assert choose_affinity([load("gpu0", 1.0), load("gpu1", 1.0)], [RATE] * 2) == 0


def test_devices_that_cannot_hold_the_model_are_never_chosen():
    loads = [load("gpu0", 3.0, fits=False), load("gpu1", 0.0, queued_s=9.0)]
    assert choose_affinity(loads, [RATE] * 2) == 1
    with pytest.raises(NoDevice):
        choose_affinity([load("gpu0", 0.0, fits=False)], [RATE])


def test_round_robin_takes_each_models_devices_in_turn():
    rr = RoundRobin()
    loads = [load("gpu0", 3.0), load("gpu1", 0.0), load("gpu2", 0.0, fits=False)]
    assert [rr.choose("a", loads) for _ in range(4)] == [0, 1, 0, 1]  # whatever they hold; never gpu2
    assert rr.choose("b", loads) == 0  # each model has its own turn


def test_fixed_spreads_the_models_over_the_devices_in_order():
    assert fixed_devices(["a", "b", "c"], ["gpu0", "gpu1"]) == {"a": "gpu0", "b": "gpu1", "c": "gpu0"}
