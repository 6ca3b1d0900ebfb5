"""Weight groups: the unit the pool keeps or evicts, and the backing segments they map to.

A group is a run of consecutive hashed chunks of a model's layout (runtime/weights/manifest.py), so a group
that comes back is streamed and verified by the loader exactly as a whole load is; groups are about one
decoder layer in size (fewer, larger groups cost fewer mappings; smaller ones let the pool keep a model's
bytes more finely). A model loaded from a plain Hugging Face directory has no chunks: it is one group.

Memory is mapped in granules (2 MiB on CUDA, a page on the host), and group boundaries need not fall on
one. So the backing is split into segments: a run of granules covered by the same groups. A segment is
mapped while any group that covers it is resident; the granule two groups share is its own segment.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass

from runtime.engine.weight_plan import WeightPlan


@dataclass(frozen=True)
class WeightGroup:
    index: int
    start: int  # byte range in the flat weight buffer
    end: int
    chunks: frozenset[int]  # the layout chunks (loader indices) it is made of; empty: the whole load

    @property
    def nbytes(self) -> int:
        return self.end - self.start


@dataclass(frozen=True)
class Segment:
    start: int
    end: int
    groups: tuple[int, ...]  # the groups whose bytes lie in it

    @property
    def nbytes(self) -> int:
        return self.end - self.start


def layer_bytes(plan: WeightPlan) -> int:
    """Bytes of one decoder layer (layer 0's tensors)."""
    return sum(t.nbytes for t in plan.tensors if t.name.startswith("model.layers.0."))


def plan_groups(chunk_spans: list[tuple[int, int]] | None, total_bytes: int, target_bytes: int) -> list[WeightGroup]:
    """Consecutive chunks ((buffer offset, length) each, in buffer order) joined into groups of at least
    TARGET_BYTES (the last may be smaller); None: one group over the whole buffer."""
    if not chunk_spans:
        return [WeightGroup(0, 0, total_bytes, frozenset())]
    groups: list[WeightGroup] = []
    members: list[int] = []
    for i, (offset, length) in enumerate(chunk_spans):
        members.append(i)
        start = chunk_spans[members[0]][0]
        if offset + length - start >= target_bytes or i == len(chunk_spans) - 1:
            groups.append(WeightGroup(len(groups), start, offset + length, frozenset(members)))
            members = []
    return groups


def plan_segments(groups: list[WeightGroup], granule: int) -> list[Segment]:
    """Split the granules under GROUPS (sorted, disjoint) into segments, each covered by one fixed set of
    groups. Ownership can change only at a group's first or last granule, so only those are looked at."""
    spans = [(g.start // granule, -(-g.end // granule)) for g in groups]
    ends = [end for _, end in spans]
    points = sorted({p for first, end in spans for p in (first, first + 1, end - 1, end)} | {0})
    points = [p for p in points if p <= ends[-1]]
    segments: list[Segment] = []
    for a, b in zip(points, points[1:]):
        at, owners = bisect.bisect_right(ends, a), []
        while at < len(spans) and spans[at][0] <= a:
            owners.append(at)
            at += 1
        if segments and segments[-1].groups == tuple(owners):
            segments[-1] = Segment(segments[-1].start, b * granule, tuple(owners))
        else:
            segments.append(Segment(a * granule, b * granule, tuple(owners)))
    return segments


def tensor_groups(plan: WeightPlan, groups: list[WeightGroup]) -> dict[str, tuple[int, ...]]:
    """The groups each planned tensor's bytes lie in."""
    starts = [g.start for g in groups]
    out = {}
    for t in plan.tensors:
        first = bisect.bisect_right(starts, t.offset) - 1
        last = bisect.bisect_left(starts, t.offset + max(t.nbytes, 1))
        out[t.name] = tuple(range(first, last))
    return out
