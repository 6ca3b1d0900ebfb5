"""Where a pointer points: relocation analysis over device regions as they came and went (Medusa 4.1).

Regions are recorded in the order the process allocated and freed them. A graph's pointers are resolved
against the regions live when that graph was captured, so an address that was freed and later handed to
another buffer is attributed to the buffer that owned it at the time, never to an earlier one. Engine
allocations are preferred over the allocator segments that may contain them.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass

import numpy as np

from snapshots.cudagraph.records import ALLOC, SEGMENT, Relocation


@dataclass(frozen=True)
class Region:
    kind: str   # ALLOC or SEGMENT
    index: int
    start: int
    size: int

    @property
    def end(self) -> int:
        return self.start + self.size


class RegionIndex:
    """The regions live at one moment, searchable by address."""

    def __init__(self, regions: list[Region]) -> None:
        # Engine allocations first: when a segment contains one, the allocation is the better name.
        self._layers = []
        for kind in (ALLOC, SEGMENT):
            layer = sorted((r for r in regions if r.kind == kind), key=lambda r: r.start)
            self._layers.append((np.array([r.start for r in layer], dtype=np.uint64),
                                 np.array([r.end for r in layer], dtype=np.uint64), layer))

    def resolve(self, address: int) -> tuple[Region, int] | None:
        for starts, ends, layer in self._layers:
            i = bisect.bisect_right(starts, address) - 1 if len(layer) else -1
            if i >= 0 and address < int(ends[i]):
                return layer[i], address - layer[i].start
        return None

    def relocations(self, buffer: bytes) -> list[Relocation]:
        """Every 8-byte-aligned word of a parameter buffer that points into a live region."""
        words = np.frombuffer(buffer[: len(buffer) // 8 * 8], dtype=np.uint64)
        found: list[Relocation] = []
        hits = np.zeros(len(words), dtype=bool)
        for starts, ends, layer in self._layers:
            if not len(layer):
                continue
            i = np.searchsorted(starts, words, side="right").astype(np.int64) - 1
            valid = (i >= 0) & ~hits
            inside = np.zeros(len(words), dtype=bool)
            inside[valid] = words[valid] < ends[i[valid]]
            for w in np.nonzero(inside)[0]:
                region = layer[i[w]]
                found.append(Relocation(int(w) * 8, region.kind, region.index, int(words[w]) - region.start))
            hits |= inside
        return sorted(found, key=lambda r: r.offset)

    def unmatched_words(self, buffer: bytes) -> list[tuple[int, int]]:
        """(offset, value) of the aligned words that no live region explains."""
        words = np.frombuffer(buffer[: len(buffer) // 8 * 8], dtype=np.uint64)
        matched = {r.offset for r in self.relocations(buffer)}
        return [(i * 8, int(v)) for i, v in enumerate(words) if i * 8 not in matched and int(v) > 0xFFFF]


class RegionTimeline:
    def __init__(self) -> None:
        self._live: dict[tuple[str, int], Region] = {}

    def allocate(self, region: Region) -> None:
        key = (region.kind, region.index)
        if key in self._live:
            raise ValueError(f"{region.kind} {region.index} allocated twice")
        self._live[key] = region

    def free(self, kind: str, index: int) -> None:
        del self._live[(kind, index)]

    def live(self) -> list[Region]:
        return list(self._live.values())

    def snapshot(self) -> RegionIndex:
        return RegionIndex(self.live())
