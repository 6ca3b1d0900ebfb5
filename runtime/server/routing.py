"""Which device a request runs on, when its model has an engine on several (PLACEMENT).

affinity (Tangram's GPU-affinity-aware scheduling, extended with the device's queue): a request goes to the
device where it would start soonest, estimated as the work queued ahead of it there plus the time to load
the bytes of its model that device does not hold (missing bytes / the device's measured load rate). A
device where the model is running already costs nothing to join. So a request goes to the device holding
most of its model unless that device's queue makes another one faster.

round-robin: the model's devices in turn, whatever they hold. fixed: each model lives on one device
(`fixed_devices`), chosen when the instance starts.

The decisions are pure functions of recorded `DeviceLoad`s, so they are tested without any device.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Sequence

POLICIES = ("affinity", "round-robin", "fixed")


@dataclass(frozen=True)
class DeviceLoad:
    """One device as a request for one model sees it."""

    device: str
    model_bytes: int   # the model's weights
    held_bytes: int    # of those, already on the device (resident or retained)
    queued_s: float    # estimated seconds before a switch to this model could start there
    running: bool      # the model serves requests there now: a new one joins its batch
    fits: bool = True  # the device's pool can hold the model at all
    free_bytes: int = 0  # of the device's pool: where the model fits without evicting, others keep theirs
    used_bytes: int = 0  # of the device's pool: what other models (and their engines) hold there

    @property
    def missing_bytes(self) -> int:
        return max(0, self.model_bytes - self.held_bytes)

    def start_s(self, load_rate: float) -> float:
        """Estimated seconds until a request for the model could start here."""
        if self.running:
            return self.queued_s
        return self.queued_s + self.missing_bytes / load_rate


class NoDevice(Exception):
    """No device of the instance can hold the model."""


def choose_affinity(loads: Sequence[DeviceLoad], load_rates: Sequence[float]) -> int:
    """The index of the device where the request would start soonest; ties go to the device holding more
    of the model, then to one where it fits without evicting, then to the one whose pool holds least (the
    models spread over the devices instead of sharing one while another idles), then to the first."""
    best: tuple[float, int, bool, int, int] | None = None
    for i, (load, rate) in enumerate(zip(loads, load_rates)):
        if not load.fits:
            continue
        evicts = load.missing_bytes > load.free_bytes
        key = (load.start_s(rate), -load.held_bytes, evicts, load.used_bytes, i)
        if best is None or key < best:
            best = key
    if best is None:
        raise NoDevice("no device can hold the model")
    return best[-1]


class RoundRobin:
    """Each model's devices in turn."""

    def __init__(self) -> None:
        self._turns: dict[str, itertools.count] = {}

    def choose(self, model: str, loads: Sequence[DeviceLoad]) -> int:
        fitting = [i for i, load in enumerate(loads) if load.fits]
        if not fitting:
            raise NoDevice("no device can hold the model")
        turn = next(self._turns.setdefault(model, itertools.count()))
        return fitting[turn % len(fitting)]


def fixed_devices(models: Sequence[str], devices: Sequence[str]) -> dict[str, str]:
    """fixed: the models spread over the devices in order, one device each (model i on device i mod N)."""
    return {model: devices[i % len(devices)] for i, model in enumerate(models)}
