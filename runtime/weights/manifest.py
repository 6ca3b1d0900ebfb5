"""The manifest of a faas-build layout (manifest.json): what is in each file, where it goes, how to verify it.

The layout's files concatenated in order ARE the engine's flat weight buffer (runtime/engine/weight_plan.py):
file `i` holds buffer bytes [buffer_offset, buffer_offset + size). Each file is hashed in `chunk_bytes`
chunks, so a loader verifies a chunk the moment it has read it.

The chunk hash is xxh3-128 by default, a non-cryptographic checksum: it catches what verification is for
(a bad disk, a truncated or damaged download, a file changed after the build) at memory speed, several
times faster than blake3 or sha256 on the same cores; a load that verifies with those is CPU-bound. It does
not stop someone who can rewrite both the files and the manifest; neither does a cryptographic chunk hash
stored beside them, unless the manifest itself is signed. `blake3` and `sha256` remain for stores that want a
cryptographic digest. The manifest names its hash, so a layout built with any of HASHES keeps loading.
"""

from __future__ import annotations

import hashlib
from dataclasses import asdict, dataclass
from pathlib import Path

import orjson

from runtime.engine.weight_plan import WeightPlan
from runtime.weights.errors import WeightsError
from runtime.weights.file_digest import mismatched, new_hasher

FORMAT_VERSION = 2  # 2: the small files have digests
HASHES = ("xxh3-128", "blake3", "sha256")
DEFAULT_HASH = "xxh3-128"
MANIFEST = "manifest.json"
#: the small files copied beside the weights (what Engine.build reads from a model directory)
MODEL_FILES = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
               "special_tokens_map.json", "chat_template.jinja", "chat_template.json")


@dataclass(frozen=True)
class TensorEntry:
    name: str
    dtype: str
    shape: tuple[int, ...]
    file: str
    offset: int  # within `file`
    length: int


@dataclass(frozen=True)
class FileEntry:
    name: str
    buffer_offset: int
    size: int
    chunk_bytes: int
    digests: tuple[str, ...]  # hex, one per chunk (the last one may be short), in the manifest's `hash`
    # the same chunks' device checksums (runtime/weights/device_checksum.py); empty in layouts built before
    # them, or where a chunk does not start on a 4-byte boundary of the weight buffer
    device_sums: tuple[str, ...] = ()

    def chunks(self) -> list[tuple[int, int]]:
        """(offset, length) of each hashed chunk of the file."""
        return [(o, min(self.chunk_bytes, self.size - o)) for o in range(0, self.size, self.chunk_bytes)]


@dataclass(frozen=True)
class Manifest:
    format_version: int
    dtype: str
    alignment: int
    hash: str  # of the chunks: one of HASHES
    content_hash: str  # of the source model: what the snapshot fingerprint keys on
    plan: WeightPlan
    files: tuple[FileEntry, ...]
    tensors: tuple[TensorEntry, ...]
    model_files: dict[str, str]  # the small files copied beside the weights: name -> digest in `hash`

    @property
    def total_bytes(self) -> int:
        return sum(f.size for f in self.files)

    @property
    def has_device_sums(self) -> bool:
        return all(len(f.device_sums) == len(f.digests) for f in self.files)

    def to_json(self) -> bytes:
        return orjson.dumps(asdict(self), option=orjson.OPT_INDENT_2)

    @classmethod
    def from_json(cls, raw: bytes, where: str = MANIFEST) -> "Manifest":
        try:
            d = orjson.loads(raw)
            if d.get("format_version") != FORMAT_VERSION:
                raise WeightsError(f"{where}: layout format {d.get('format_version')!r}, this runtime reads "
                                   f"{FORMAT_VERSION}: rebuild it with this faas-build")
            if d["hash"] not in HASHES:
                raise WeightsError(f"{where}: chunk hash {d['hash']!r} is not one of {', '.join(HASHES)}")
            return cls(d["format_version"], d["dtype"], d["alignment"], d["hash"], d["content_hash"],
                       WeightPlan.from_dict(d["plan"]),
                       tuple(FileEntry(f["name"], f["buffer_offset"], f["size"], f["chunk_bytes"],
                                       tuple(f["digests"]), tuple(f.get("device_sums", ())))
                             for f in d["files"]),
                       tuple(TensorEntry(t["name"], t["dtype"], tuple(t["shape"]), t["file"], t["offset"],
                                         t["length"]) for t in d["tensors"]),
                       dict(d["model_files"]))
        except (orjson.JSONDecodeError, KeyError, TypeError, ValueError) as exc:
            raise WeightsError(f"{where}: not a faas-build manifest ({type(exc).__name__}: {exc})") from None

    @classmethod
    def read(cls, layout_dir: Path) -> "Manifest":
        path = Path(layout_dir) / MANIFEST
        return cls.from_json(path.read_bytes(), str(path))

    def identity(self) -> str:
        """Names this exact layout (every chunk hash is in it): the disk cache's key."""
        return hashlib.sha256(self.to_json()).hexdigest()[:32]


def chunk_hasher(name: str):
    """A new hash object of the manifest's kind (each releases the GIL on large buffers)."""
    return new_hasher(name)


def check_model_files(layout_dir: Path, manifest: Manifest) -> None:
    """The layout's small files (config, tokenizer, chat template, generation config) are those it was built
    with: each listed one has its digest, and none the engine would read is there unlisted. Raises
    WeightsError naming the file."""
    layout_dir = Path(layout_dir)
    bad = mismatched(layout_dir, manifest.model_files, manifest.hash)
    if bad:
        raise WeightsError(f"{layout_dir}: {bad[0]} does not match the layout's manifest{_more(bad)}: the layout "
                           "was changed after it was built (rebuild it, or restore the file)")
    unlisted = [n for n in MODEL_FILES if n not in manifest.model_files and (layout_dir / n).exists()]
    if unlisted:
        raise WeightsError(f"{layout_dir}: {unlisted[0]} is not in the layout's manifest: it was added after "
                           "the layout was built (remove it, or rebuild the layout)")


def _more(names: list[str]) -> str:
    return f" (and {', '.join(names[1:])})" if len(names) > 1 else ""


def is_layout(path: Path) -> bool:
    return (Path(path) / MANIFEST).is_file()
