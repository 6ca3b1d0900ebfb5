"""The input embedding table's block digests (`embedding-blocks.digests` in a faas-build layout): what lets a
restored runtime answer before the table has all been read.

A step needs only its own tokens' rows of the input embedding table; Llama-3-8B's table is 1 GiB of its 15 GiB.
From cold disk a process restore reads the table's whole chunks last (EMBEDDING_LAST): the entry point's
prefetch starts them only once every other weight has been read, the weights' helper streams every other chunk,
and the restored runtime serves once those have arrived, reading the rows each step needs from the layout
itself until the rest of the table is in (runtime/engine/embedding_fill.py). A chunk's digest covers 64 MiB,
so each block of ROWS_PER_BLOCK rows has a digest of its own here, in the manifest's hash. The file is one of
the layout's model files: checked against the manifest before any digest in it is trusted.

Only where the table is not also the output projection (a tied table is the first token's logits: all of it is
needed) and holds at least one whole chunk. Imports nothing heavy: the entry point's prefetch orders its reads
with `deferred_span` before the bootstrap's imports.
"""

from __future__ import annotations

import os
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from runtime.engine.weight_plan import WeightPlan
    from runtime.weights.manifest import FileEntry, Manifest

BLOCKS_FILE = "embedding-blocks.digests"
TABLE = "model.embed_tokens.weight"
OUTPUT = "lm_head.weight"  # planned only when the table is not tied to the output projection
#: a block: what one on-demand read fetches and checks (8 rows: 64 KiB of Llama-3-8B's bfloat16 table)
ROWS_PER_BLOCK = 8
_MAGIC = b"thawemb1"
_HEADER = struct.Struct("<8sII")  # magic, rows per block, digest bytes


def deferred_span(tensors: list[tuple[str, int, int]], chunks: list[tuple[int, int]]) -> tuple[int, int] | None:
    """The weight buffer's bytes [start, end) a restore may read last: the table's whole chunks. TENSORS: each
    planned tensor's (name, buffer offset, bytes); CHUNKS: each layout chunk's (buffer offset, bytes), in
    order. None where nothing may be deferred (a tied table, or one smaller than a chunk)."""
    planned = {name: (offset, nbytes) for name, offset, nbytes in tensors}
    if TABLE not in planned or OUTPUT not in planned:
        return None
    offset, nbytes = planned[TABLE]
    inside = [(o, n) for o, n in chunks if o >= offset and o + n <= offset + nbytes]
    if not inside:
        return None
    return inside[0][0], inside[-1][0] + inside[-1][1]


def deferred_chunks(manifest: "Manifest") -> frozenset[int]:
    """The layout chunks (runtime/weights/loader.py's `layout_chunks` order) a restore may read last: none
    unless the layout has block digests for its table."""
    from runtime.weights.loader import layout_chunks

    if BLOCKS_FILE not in manifest.model_files:
        return frozenset()
    chunks = [(c.buffer_offset, c.length) for c in layout_chunks(manifest)]
    span = deferred_span([(t.name, t.offset, t.nbytes) for t in manifest.plan.tensors], chunks)
    if span is None:
        return frozenset()
    return frozenset(i for i, (o, n) in enumerate(chunks) if o >= span[0] and o + n <= span[1])


def raw_deferred_span(manifest: dict) -> tuple[str, int, int] | None:
    """`deferred_span` from a manifest's JSON (the entry point reads it before the bootstrap's imports): the
    file and its bytes [start, end); None where nothing may be deferred."""
    if BLOCKS_FILE not in manifest.get("model_files", {}):
        return None
    files = manifest["files"]
    chunks = [(f["buffer_offset"] + o, min(f["chunk_bytes"], f["size"] - o))
              for f in files for o in range(0, f["size"], f["chunk_bytes"])]
    span = deferred_span([(t["name"], t["offset"], t["nbytes"]) for t in manifest["plan"]["tensors"]], chunks)
    if span is None:
        return None
    for f in files:
        if f["buffer_offset"] <= span[0] < f["buffer_offset"] + f["size"]:
            return f["name"], span[0] - f["buffer_offset"], span[1] - f["buffer_offset"]
    return None


@dataclass(frozen=True)
class EmbeddingBlocks:
    """Where the table lies in the layout and the weight buffer, and each block's digest."""

    file: Path  # the layout file that holds the table
    file_offset: int  # of the table in it
    buffer_offset: int  # of the table in the weight buffer
    rows: int
    row_bytes: int
    rows_per_block: int
    hash: str
    digests: bytes  # each block's, concatenated

    @property
    def digest_bytes(self) -> int:
        return len(self.digests) // self.blocks

    @property
    def blocks(self) -> int:
        return -(-self.rows // self.rows_per_block)

    def block_bytes(self, block: int) -> tuple[int, int]:
        """(offset in the table, bytes) of BLOCK."""
        first = block * self.rows_per_block
        return first * self.row_bytes, (min(first + self.rows_per_block, self.rows) - first) * self.row_bytes

    def digest(self, block: int) -> bytes:
        return self.digests[block * self.digest_bytes:(block + 1) * self.digest_bytes]

    def check(self, block: int, data) -> bool:
        from runtime.weights.manifest import chunk_hasher

        h = chunk_hasher(self.hash)
        h.update(data)
        return h.digest() == self.digest(block)

    @classmethod
    def read(cls, layout_dir: Path, manifest: "Manifest") -> "EmbeddingBlocks":
        """The layout's block digests, the file checked against the manifest first. Raises WeightsError."""
        from runtime.weights.errors import WeightsError
        from runtime.weights.file_digest import file_digest

        path = Path(layout_dir) / BLOCKS_FILE
        if BLOCKS_FILE not in manifest.model_files:
            raise WeightsError(f"{layout_dir}: the layout has no {BLOCKS_FILE} (rebuild it with this faas-build)")
        try:
            matches = file_digest(path, manifest.hash) == manifest.model_files[BLOCKS_FILE]
            raw = path.read_bytes() if matches else b""
        except OSError as exc:
            raise WeightsError(f"{path}: {exc.strerror}") from None
        if not matches:
            raise WeightsError(f"{path} does not match the layout's manifest: the layout was changed after it "
                               "was built (rebuild it, or restore the file)")
        magic, rows_per_block, digest_bytes = _HEADER.unpack_from(raw)
        table = manifest.plan.by_name()[TABLE]
        entry = _file_of(manifest.files, table.offset)
        blocks = cls(path.parent / entry.name, table.offset - entry.buffer_offset, table.offset, table.shape[0],
                     table.nbytes // table.shape[0], rows_per_block, manifest.hash, raw[_HEADER.size:])
        if magic != _MAGIC or len(blocks.digests) != blocks.blocks * digest_bytes:
            raise WeightsError(f"{path}: not the block digests of this layout's embedding table")
        return blocks


def _file_of(files: "tuple[FileEntry, ...]", buffer_offset: int) -> "FileEntry":
    return next(f for f in files if f.buffer_offset <= buffer_offset < f.buffer_offset + f.size)


def write_block_digests(out: Path, plan: "WeightPlan", entry: "FileEntry", hash: str) -> bool:
    """faas-build: write BLOCKS_FILE into the layout directory OUT once its weight file ENTRY is written, if the
    table is in it and a restore may defer part of it; False otherwise (nothing written)."""
    from runtime.weights.manifest import chunk_hasher

    table = plan.by_name().get(TABLE)
    if table is None or not entry.buffer_offset <= table.offset < entry.buffer_offset + entry.size:
        return False
    chunks = [(entry.buffer_offset + o, n) for o, n in entry.chunks()]
    if deferred_span([(t.name, t.offset, t.nbytes) for t in plan.tensors], chunks) is None:
        return False
    row_bytes = table.nbytes // table.shape[0]
    block_bytes = ROWS_PER_BLOCK * row_bytes
    digests = []
    with open(out / entry.name, "rb") as f:
        start = table.offset - entry.buffer_offset
        for offset in range(0, table.nbytes, block_bytes):
            h = chunk_hasher(hash)
            h.update(os.pread(f.fileno(), min(block_bytes, table.nbytes - offset), start + offset))
            digests.append(h.digest())
    (out / BLOCKS_FILE).write_bytes(_HEADER.pack(_MAGIC, ROWS_PER_BLOCK, len(digests[0])) + b"".join(digests))
    return True
