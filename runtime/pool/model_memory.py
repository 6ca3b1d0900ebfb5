"""One model's memory in the pool: its weight buffer split into groups over a backing whose parts can be
given back, which groups are resident, and its KV cache."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import torch

from runtime.engine.weight_plan import WeightPlan
from runtime.pool.backing import Backing, make_backing
from runtime.pool.eviction import RequestRate
from runtime.pool.groups import Segment, WeightGroup, layer_bytes, plan_groups, plan_segments, tensor_groups
from runtime.pool.kv import KVMemory


@dataclass
class Counters:
    loads: int = 0  # activations that streamed bytes (the first start included)
    switches: int = 0  # activations that followed another model's on this pool
    last_switch: Any = None  # the pool's SwitchReport of the last activation that loaded bytes
    bytes_loaded: int = 0
    switch_seconds: list[float] = field(default_factory=list)


class ModelMemory:
    """Weights: groups over one backing (MappedRange or HostRange) at fixed addresses; a segment of the
    backing is mapped while any group over it is resident. The KV cache: a backing of its own, backed in
    chunks on demand (runtime/pool/kv.py)."""

    def __init__(self, name: str, plan: WeightPlan, chunk_spans: list[tuple[int, int]] | None,
                 device: torch.device, granule: int, kv: KVMemory) -> None:
        self.name = name
        self.plan = plan
        self.device = device
        self.groups: list[WeightGroup] = plan_groups(chunk_spans, plan.total_bytes, max(layer_bytes(plan), 1))
        self.segments: list[Segment] = plan_segments(self.groups, granule)
        self.tensor_groups = tensor_groups(plan, self.groups)
        self.resident: set[int] = set()
        self.weights: Backing | None = None
        self.kv = kv
        self.fixed_bytes = 0  # what the started engine holds outside the pool's backings
        self.held = 0
        self.started = False
        self.first_start = None  # the pool's SwitchReport of the activation that started the engine
        self.rate = RequestRate()
        self.last_used = 0.0
        self.load_bytes_per_s = 0.0  # measured on its last load; 0: not measured yet
        self.counters = Counters()

    # -- sizes -------------------------------------------------------------------------------------

    @property
    def total_bytes(self) -> int:
        """Its weights as mapped when all resident (whole granules)."""
        return sum(s.nbytes for s in self.segments)

    @property
    def resident_bytes(self) -> int:
        return self.mapped_bytes(self.resident)

    def mapped_bytes(self, resident: set[int]) -> int:
        return sum(s.nbytes for s in self.segments if any(g in resident for g in s.groups))

    def missing(self) -> list[int]:
        return [g.index for g in self.groups if g.index not in self.resident]

    def used_bytes(self) -> int:
        """Everything of this model the pool accounts for."""
        return self.resident_bytes + self.kv.mapped_bytes + self.fixed_bytes

    # -- backing -----------------------------------------------------------------------------------

    def ensure_backing(self, spares=None) -> None:
        if self.weights is None:
            self.weights = make_backing(self.plan.total_bytes, self.device, spares)

    def map_groups(self, indices: list[int]) -> None:
        """Back the segments of groups INDICES that are not backed yet; the groups count as resident from
        here (their bytes arrive with the load that follows)."""
        after = self.resident | set(indices)
        self.weights.map([(s.start, s.end) for s in self.segments
                          if any(g in after for g in s.groups) and not any(g in self.resident for g in s.groups)])
        self.resident = after

    def unmap_groups(self, indices: list[int]) -> int:
        """Give back the memory of groups INDICES; returns the bytes given back."""
        after = self.resident - set(indices)
        gone = [s for s in self.segments
                if any(g in self.resident for g in s.groups) and not any(g in after for g in s.groups)]
        self.weights.unmap([(s.start, s.end) for s in gone])
        self.resident = after
        return sum(s.nbytes for s in gone)

    def chunks_of(self, indices: list[int]) -> frozenset[int]:
        return frozenset(c for i in indices for c in self.groups[i].chunks)

    def note_request(self, now: float | None = None) -> None:
        self.rate.note(time.time() if now is None else now)
