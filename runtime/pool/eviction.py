"""Which retained weight groups to give back when the pool is short.

Tangram's cost model (docs/multi-model.md): keeping a group of an inactive model saves reloading it later,
which costs its bytes over the model's measured load rate, and matters in proportion to how likely the
model is to be asked for again: its recent request rate, exponentially decayed. Choosing what to keep is a
knapsack: items are the retained groups, each with bytes and that value; the capacity is what stays
retained after the bytes the pool needs are freed. Each model's choice (which of its groups it keeps) is
one choice of a multi-choice knapsack; a pool is one device, so one dimension (a multi-GPU instance has one
pool, one knapsack, per GPU).

`keep_most_valuable` is the heuristic: groups by value per byte, largest first, each kept if it fits, and
the single most valuable group instead if that alone is worth more (the classic guard that makes greedy a
1/2-approximation). It leaves at most one group's value on the table against the optimum: the greedy fill
reaches the linear relaxation's value minus the value of the first group that did not fit. The tests check
that bound against an exact solver. `lru_whole_models` is the comparison policy: whole models, least
recently used first.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

#: how fast a model's request rate forgets (seconds): a model asked for a minute ago still counts ~37%
RATE_HALF_LIFE_S = 60.0


@dataclass(frozen=True)
class Item:
    model: str
    group: int
    nbytes: int
    value: float  # seconds of reload saved, weighted by the model's request rate


class RequestRate:
    """A request rate that decays exponentially (requests per second, recent ones weighing most)."""

    def __init__(self, half_life_s: float = RATE_HALF_LIFE_S) -> None:
        self._decay = math.log(2) / half_life_s
        self._value = 0.0
        self._at = 0.0

    def note(self, now: float) -> None:
        self._value = self.at(now) + self._decay
        self._at = max(self._at, now)

    def at(self, now: float) -> float:
        return self._value * math.exp(-self._decay * max(0.0, now - self._at))


def group_value(nbytes: int, load_bytes_per_s: float, rate: float) -> float:
    """Tangram's eviction cost of a group: its reload seconds times its model's miss likelihood. A model
    nobody asked for lately still has a small weight, so that ties break on reload time, not at random."""
    return nbytes / max(load_bytes_per_s, 1.0) * (rate + 1e-6)


def keep_most_valuable(items: list[Item], capacity: int) -> list[Item]:
    """The items to keep within CAPACITY bytes, by the greedy-with-best-single-item heuristic."""
    kept, used = [], 0
    for item in sorted(items, key=lambda i: (-i.value / max(i.nbytes, 1), i.model, i.group)):
        if used + item.nbytes <= capacity:
            kept.append(item)
            used += item.nbytes
    fitting = [i for i in items if i.nbytes <= capacity]
    best = max(fitting, key=lambda i: i.value, default=None)
    if best is not None and best.value > sum(i.value for i in kept):
        return [best]
    return kept


def evict_by_cost(items: list[Item], short: int) -> list[Item]:
    """The items to evict so that at least SHORT bytes are freed, keeping the most valuable rest."""
    retained = sum(i.nbytes for i in items)
    if short <= 0:
        return []
    kept = {(i.model, i.group) for i in keep_most_valuable(items, max(0, retained - short))}
    return [i for i in items if (i.model, i.group) not in kept]


def lru_whole_models(items: list[Item], short: int, last_used: dict[str, float]) -> list[Item]:
    """Whole models, least recently used first, until at least SHORT bytes are freed."""
    evicted, freed = [], 0
    for model in sorted({i.model for i in items}, key=lambda m: last_used.get(m, 0.0)):
        if freed >= short:
            break
        mine = [i for i in items if i.model == model]
        evicted += mine
        freed += sum(i.nbytes for i in mine)
    return evicted
