"""Bake time: capture the decode graphs while tracking device regions, and describe every graph.

The engine's logged allocations are regions from the start; the torch allocator's segments (the graph
pool, library workspaces) are read after each capture, so each graph is resolved against exactly the
regions that were live when it was captured (snapshots/cudagraph/relocate.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from runtime.cuda_driver import graphs as cu
from runtime.engine.model_runner import ModelRunner
from snapshots.cudagraph.describe import describe_graph
from snapshots.cudagraph.records import (ALLOC, SEGMENT, GraphRecord, GraphSet, KernelNode, MemsetNode, Relocation,
                                        RelocationTable, SegmentRecord)
from snapshots.cudagraph.relocate import Region, RegionIndex, RegionTimeline

#: scratch segments other than the graph pool are saved when a graph points into them, up to this size
MAX_SAVED_SEGMENT_BYTES = 64 << 20


@dataclass
class Materialized:
    graph_set: GraphSet
    params: bytes
    segment_contents: dict[int, bytes]
    problems: dict[int, list[str]]                  # batch size -> why it cannot be restored
    regions: dict[int, list[Region]] = field(default_factory=dict)  # what each graph was resolved against


class SegmentTracker:
    """Follows the torch allocator's segments as regions of a RegionTimeline."""

    def __init__(self, timeline: RegionTimeline) -> None:
        self.timeline = timeline
        self.ordinals: dict[int, int] = {}          # segment address -> ordinal
        self.info: dict[int, tuple[int, int, object]] = {}  # ordinal -> (address, size, pool id)
        self._next = 0

    def sync(self) -> None:
        current = {s["address"]: s for s in torch.cuda.memory_snapshot()}
        for address in [a for a in self.ordinals if a not in current]:
            self.timeline.free(SEGMENT, self.ordinals.pop(address))
        for address, segment in current.items():
            if address not in self.ordinals:
                ordinal, self._next = self._next, self._next + 1
                self.ordinals[address] = ordinal
                self.info[ordinal] = (address, segment["total_size"], segment.get("segment_pool_id"))
                self.timeline.allocate(Region(SEGMENT, ordinal, address, segment["total_size"]))


def capture_and_describe(runner: ModelRunner) -> Materialized:
    timeline = RegionTimeline()
    for a in runner.allocator.log:
        timeline.allocate(Region(ALLOC, a.index, a.ptr, a.nbytes))
    segments = SegmentTracker(timeline)
    segments.sync()
    indexes: dict[int, RegionIndex] = {}
    regions: dict[int, list[Region]] = {}

    def captured(bs: int, graph: torch.cuda.CUDAGraph) -> None:
        segments.sync()
        indexes[bs] = timeline.snapshot()
        regions[bs] = timeline.live()

    runner.capture_graphs(keep_graphs=True, on_captured=captured)
    blob = bytearray()
    relocations: list[tuple[int, Relocation]] = []
    records: list[GraphRecord] = []
    problems: dict[int, list[str]] = {}
    functions: dict[str, set[int]] = {}
    for bs in sorted(runner.graphs):
        description = describe_graph(runner.graphs[bs].raw_cuda_graph(), bs, indexes[bs], blob, relocations)
        records.append(description.record)
        for name, funcs in description.functions.items():
            functions.setdefault(name, set()).update(funcs)
        if description.problems:
            problems[bs] = description.problems
    ambiguous = {name for name, funcs in functions.items() if len(funcs) > 1}
    for record in records:
        clash = sorted({n.name for n in record.nodes if isinstance(n, KernelNode)} & ambiguous)
        if clash:
            problems.setdefault(record.batch_size, []).append(
                f"kernel name {clash[0][:60]} belongs to {len(functions[clash[0]])} different functions")
    table = RelocationTable.of(relocations)
    segment_records, contents = _referenced_segments(records, table, segments, runner.graph_pool)
    names = sorted({n.name for r in records for n in r.nodes if isinstance(n, KernelNode)})
    graph_set = GraphSet([(a.name, a.nbytes) for a in runner.allocator.log], segment_records, records, names, table)
    return Materialized(graph_set, bytes(blob), contents, problems, regions)


def _referenced_segments(records: list[GraphRecord], table: RelocationTable, segments: SegmentTracker,
                         pool: object) -> tuple[list[SegmentRecord], dict[int, bytes]]:
    used = table.regions(SEGMENT)
    for record in records:
        for node in record.nodes:
            if isinstance(node, MemsetNode) and node.dst.kind == SEGMENT:
                used.add(node.dst.index)
    out, contents = [], {}
    for ordinal in sorted(used):
        address, size, pool_id = segments.info[ordinal]
        in_pool = pool_id == pool
        saved = None
        if not in_pool and size <= MAX_SAVED_SEGMENT_BYTES:
            # Not a graph temporary: it may hold state a replay reads before writing (Medusa 4.3).
            saved = f"segment-{ordinal}.bin"
            contents[ordinal] = cu.copy_to_host(address, size)
        out.append(SegmentRecord(ordinal, size, in_pool, saved))
    return out, contents
