"""The materialised form of the decode CUDA graphs: what is written at bake time and read at boot.

A graph is a list of nodes in topological order. A kernel node keeps its function's name (handles differ per
process), launch shape, launch attributes and its raw parameter buffer; every pointer-sized word of that
buffer that pointed into device memory is listed as a relocation: which region (an engine allocation, by
its index in the allocation log, or a scratch segment such as the graph pool) and the offset inside it.
On disk: `graphs.json` (structure) and `params.bin` (all parameter buffers, 8-byte aligned).
"""

from __future__ import annotations

import base64
from dataclasses import asdict, dataclass, field
from pathlib import Path

import orjson

FORMAT_VERSION = 2

ALLOC = "alloc"      # an engine allocation (runtime/engine/allocator.py), by log index
SEGMENT = "segment"  # a scratch segment of the torch allocator (graph pool, library workspaces), by ordinal


@dataclass(frozen=True)
class Relocation:
    offset: int   # byte offset in the parameter buffer (kernel) or 0 for a memset's destination
    kind: str     # ALLOC or SEGMENT
    index: int
    delta: int    # offset inside the region


@dataclass
class KernelNode:
    name: str
    grid: tuple[int, int, int]
    block: tuple[int, int, int]
    shared_mem: int
    params_offset: int            # where its parameter buffer starts in params.bin
    params_size: int
    relocations: list[Relocation]
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
    version: int = FORMAT_VERSION

    def save(self, directory: Path, params: bytes) -> None:
        directory.mkdir(parents=True, exist_ok=True)
        (directory / "params.bin").write_bytes(params)
        (directory / "graphs.json").write_bytes(orjson.dumps(asdict(self), option=orjson.OPT_NON_STR_KEYS))

    @classmethod
    def load(cls, directory: Path) -> tuple["GraphSet", bytes]:
        raw = orjson.loads((directory / "graphs.json").read_bytes())
        if raw.get("version") != FORMAT_VERSION:
            raise ValueError(f"graph snapshot format {raw.get('version')} is not {FORMAT_VERSION}")
        graphs = [GraphRecord(g["batch_size"], [_node(n) for n in g["nodes"]]) for g in raw["graphs"]]
        segments = [SegmentRecord(**s) for s in raw["segments"]]
        allocations = [tuple(a) for a in raw["allocations"]]
        return cls(allocations, segments, graphs, raw["kernel_names"]), (directory / "params.bin").read_bytes()


def _node(raw: dict) -> Node:
    kind = raw.pop("kind")
    if raw.get("edges") is not None:
        raw["edges"] = [tuple(e) for e in raw["edges"]]
    if kind == "kernel":
        raw["relocations"] = [Relocation(**r) for r in raw["relocations"]]
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
