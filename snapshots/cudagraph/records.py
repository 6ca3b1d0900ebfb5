"""The materialised form of the decode CUDA graphs: what is written at bake time and read at boot.

A graph is a list of nodes in topological order. A kernel node keeps its function's name (handles differ per
process), launch shape, launch attributes and where its raw parameter buffer lies in params.bin; every
pointer-sized word of those buffers that pointed into device memory is a row of the relocation table: which
region (an engine allocation, by its index in the allocation log, or a scratch segment such as the graph
pool) and the offset inside it.
On disk: `graphs.json` (structure), `params.bin` (all parameter buffers, 8-byte aligned) and
`relocations.npy` (the table as columns: a 35-graph set has some 200,000 relocations, which as JSON objects
took longer to read at boot than everything else in the file).
"""

from __future__ import annotations

import base64
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable

import numpy as np
import orjson

FORMAT_VERSION = 3

ALLOC = "alloc"      # an engine allocation (runtime/engine/allocator.py), by log index
SEGMENT = "segment"  # a scratch segment of the torch allocator (graph pool, library workspaces), by ordinal


@dataclass(frozen=True)
class Relocation:
    offset: int   # byte offset in the parameter buffer (kernel) or 0 for a memset's destination
    kind: str     # ALLOC or SEGMENT
    index: int
    delta: int    # offset inside the region


KINDS = (ALLOC, SEGMENT)
_ROW = np.dtype([("word", "<i8"), ("kind", "u1"), ("index", "<i4"), ("delta", "<i8")])


class RelocationTable:
    """Every relocated parameter word of a graph set, in params.bin order: `word` is the word's index in
    params.bin (byte offset / 8), `kind` an index into KINDS."""

    def __init__(self, rows: np.ndarray | None = None) -> None:
        self.rows = np.zeros(0, dtype=_ROW) if rows is None else rows

    @classmethod
    def of(cls, entries: list[tuple[int, Relocation]]) -> "RelocationTable":
        """From (byte offset of the parameter buffer in params.bin, relocation) pairs."""
        rows = np.array([((start + r.offset) // 8, KINDS.index(r.kind), r.index, r.delta) for start, r in entries],
                        dtype=_ROW)
        return cls(rows[np.argsort(rows["word"], kind="stable")])

    def within(self, start: int, size: int) -> list[Relocation]:
        """The relocations of the parameter buffer at bytes [start, start + size) of params.bin."""
        lo, hi = np.searchsorted(self.rows["word"], [start // 8, (start + size) // 8])
        return [Relocation(int(w) * 8 - start, KINDS[k], int(i), int(d)) for w, k, i, d in self.rows[lo:hi].tolist()]

    def regions(self, kind: str) -> set[int]:
        return set(self.rows["index"][self.rows["kind"] == KINDS.index(kind)].tolist())

    def __len__(self) -> int:
        return len(self.rows)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, RelocationTable) and np.array_equal(self.rows, other.rows)


@dataclass
class KernelNode:
    name: str
    grid: tuple[int, int, int]
    block: tuple[int, int, int]
    shared_mem: int
    params_offset: int            # where its parameter buffer starts in params.bin
    params_size: int
    attributes: dict[int, str] = field(default_factory=dict)  # launch attribute id -> base64 of 64 raw bytes
    deps: list[int] = field(default_factory=list)
    edges: list[tuple[int, int, int]] | None = None  # (from_port, to_port, type) per dep, when not all default
    kind: str = "kernel"


@dataclass
class MemsetNode:
    dst: Relocation
    value: int
    element_size: int
    width: int
    height: int
    pitch: int
    deps: list[int] = field(default_factory=list)
    edges: list[tuple[int, int, int]] | None = None
    kind: str = "memset"


@dataclass
class EmptyNode:
    deps: list[int] = field(default_factory=list)
    edges: list[tuple[int, int, int]] | None = None
    kind: str = "empty"


Node = KernelNode | MemsetNode | EmptyNode


@dataclass
class GraphRecord:
    batch_size: int
    nodes: list[Node]


@dataclass(frozen=True)
class SegmentRecord:
    """A scratch region to recreate (same size) at boot; `contents` names a saved copy when it matters."""

    ordinal: int
    size: int
    pool: bool
    contents: str | None = None


@dataclass
class GraphSet:
    allocations: list[tuple[str, int]]  # the engine's allocation log at capture: (name, nbytes), in order
    segments: list[SegmentRecord]
    graphs: list[GraphRecord]
    kernel_names: list[str]
    relocations: RelocationTable = field(default_factory=RelocationTable)
    version: int = FORMAT_VERSION
    # graphs read but not yet parsed into records (`load(parse=...)`): batch size -> nodes as JSON
    unparsed: dict[int, list[dict]] = field(default_factory=dict)

    def node_relocations(self, node: KernelNode) -> list[Relocation]:
        return self.relocations.within(node.params_offset, node.params_size)

    def save(self, directory: Path, params: bytes) -> None:
        directory.mkdir(parents=True, exist_ok=True)
        (directory / "params.bin").write_bytes(params)
        np.save(directory / "relocations.npy", self.relocations.rows, allow_pickle=False)
        structure = {"allocations": self.allocations, "segments": [asdict(x) for x in self.segments],
                     "graphs": [asdict(g) for g in self.graphs], "kernel_names": self.kernel_names,
                     "version": self.version}
        (directory / "graphs.json").write_bytes(orjson.dumps(structure, option=orjson.OPT_NON_STR_KEYS))

    @classmethod
    def load(cls, directory: Path, parse: Callable[[int], bool] | None = None) -> tuple["GraphSet", bytes]:
        """The set and params.bin. Only graphs whose batch size `parse` accepts (default: all) become records
        now; the others stay in `unparsed` until `parse_graph` (a set of 35 has some 12,000 nodes, and
        turning them all into records took a tenth of a second of a boot that needs four graphs)."""
        raw = orjson.loads((directory / "graphs.json").read_bytes())
        if raw.get("version") != FORMAT_VERSION:
            raise ValueError(f"graph snapshot format {raw.get('version')} is not {FORMAT_VERSION}")
        graphs, unparsed = [], {}
        for g in raw["graphs"]:
            if parse is None or parse(g["batch_size"]):
                graphs.append(GraphRecord(g["batch_size"], [_node(n) for n in g["nodes"]]))
            else:
                unparsed[g["batch_size"]] = g["nodes"]
        segments = [SegmentRecord(**s) for s in raw["segments"]]
        allocations = [tuple(a) for a in raw["allocations"]]
        rows = np.load(directory / "relocations.npy", allow_pickle=False)
        if rows.dtype != _ROW:
            raise ValueError(f"relocations.npy holds {rows.dtype}, not {_ROW}")
        graph_set = cls(allocations, segments, graphs, raw["kernel_names"], RelocationTable(rows), unparsed=unparsed)
        return graph_set, (directory / "params.bin").read_bytes()

    def parse_graph(self, batch_size: int) -> GraphRecord:
        """Turn a graph `load` left unparsed into a record (and add it to `graphs`)."""
        record = GraphRecord(batch_size, [_node(n) for n in self.unparsed.pop(batch_size)])
        self.graphs.append(record)
        return record


def _node(raw: dict) -> Node:
    kind = raw.pop("kind")
    if raw.get("edges") is not None:
        raw["edges"] = [tuple(e) for e in raw["edges"]]
    if kind == "kernel":
        raw["attributes"] = {int(k): v for k, v in raw["attributes"].items()}
        raw["grid"], raw["block"] = tuple(raw["grid"]), tuple(raw["block"])
        return KernelNode(**raw)
    if kind == "memset":
        raw["dst"] = Relocation(**raw["dst"])
        return MemsetNode(**raw)
    return EmptyNode(**raw)


def encode_attribute(raw: bytes) -> str:
    return base64.b64encode(raw).decode()


def decode_attribute(text: str) -> bytes:
    return base64.b64decode(text)
