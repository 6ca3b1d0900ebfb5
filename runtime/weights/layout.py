"""faas-build's weights step: a model (Hugging Face directory, GGUF file, or either under an s3:// prefix)
-> a loading-optimised layout (manifest.py) in a local directory or under an s3:// prefix.

The layout's bytes are the engine's flat weight buffer for (model config, dtype): the tensors in allocation
order at the plan's offsets, split at tensor boundaries into files of about `file_bytes`. Everything is
written under a temporary name and renamed (or, on S3, the manifest is uploaded last), so an interrupted
build leaves no layout behind.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Callable

import torch
from tqdm import tqdm

from runtime.engine.model_config import ModelConfig
from runtime.engine.weight_plan import ITEMSIZES, PlannedTensor, WeightPlan, plan_weights, torch_dtype
from runtime.logs import get_logger
from runtime.weights.device_checksum import ChunkSum
from runtime.weights.embedding_blocks import BLOCKS_FILE, write_block_digests
from runtime.weights.errors import WeightsError
from runtime.weights.file_digest import file_digests
from runtime.weights.manifest import (
    DEFAULT_HASH,
    FORMAT_VERSION,
    HASHES,
    MANIFEST,
    MODEL_FILES,
    FileEntry,
    Manifest,
    TensorEntry,
    chunk_hasher,
    is_layout,
)
from runtime.weights.s3 import S3Store, is_s3, join_key, split_url
from runtime.weights.temps import remove_dead_temps, temp_beside

log = get_logger("weights.layout")

MiB, GiB = 1 << 20, 1 << 30
HASH_BLOCK = 16 * MiB


def write_layout(source: str, out: str, *, dtype: str = "bfloat16", file_bytes: int = 2 * GiB,
                 chunk_bytes: int = 64 * MiB, hash: str = DEFAULT_HASH, store: S3Store | None = None,
                 progress: bool = True) -> Manifest:
    """Build the layout of `source` at `out` (a local directory that must not exist yet, or an s3:// prefix
    without a manifest.json). Returns its manifest."""
    if dtype not in ITEMSIZES:
        raise WeightsError(f"dtype {dtype!r}: choose one of {', '.join(ITEMSIZES)}")
    if hash not in HASHES:
        raise WeightsError(f"hash {hash!r}: choose one of {', '.join(HASHES)}")
    if chunk_bytes <= 0 or file_bytes <= 0:
        raise WeightsError("chunk and file sizes must be positive")
    store = store or (S3Store() if is_s3(source) or is_s3(out) else None)
    _check_out_free(out, store)
    with tempfile.TemporaryDirectory(prefix="faas-build-") as scratch:
        model_dir, content_hash = _local_source(source, Path(scratch), store, progress)
        if is_s3(out):  # each weight file goes up as soon as it is written: local room for one, not all
            staged = Path(scratch) / "layout"
            with LayoutUpload(out, store, progress) as upload:
                manifest = _write_local(model_dir, staged, dtype, file_bytes, chunk_bytes, hash, content_hash,
                                        progress, on_file=lambda path: upload.put(path, remove=True))
                for name in manifest.model_files:
                    upload.put(staged / name)
                upload.finish(manifest)
            return manifest
        final = Path(out)
        temp = temp_beside(final)
        final.parent.mkdir(parents=True, exist_ok=True)
        remove_dead_temps(final)
        try:
            manifest = _write_local(model_dir, temp, dtype, file_bytes, chunk_bytes, hash, content_hash, progress)
            os.rename(temp, final)
        finally:
            shutil.rmtree(temp, ignore_errors=True)
        return manifest


# -- sources -----------------------------------------------------------------------------------------------

def _local_source(source: str, scratch: Path, store: S3Store | None, progress: bool) -> tuple[Path, str]:
    """A local Hugging Face directory for `source` and the content hash of what was given."""
    if is_s3(source):
        source = str(download_prefix(source, scratch / "source", store, progress))
    path = Path(source).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        from runtime.weights.gguf_import import GGUFImportError, import_gguf

        try:
            return import_gguf(path, scratch / "imported", progress), content_hash([path], path.parent)
        except GGUFImportError as exc:
            raise WeightsError(str(exc)) from None
    if path.is_file():
        raise WeightsError(f"{source} is not a .gguf file nor a Hugging Face model directory")
    if is_layout(path):
        raise WeightsError(f"{source} is already a faas-build layout")
    if not (path / "config.json").is_file() or not list(path.glob("*.safetensors")):
        raise WeightsError(f"{source} is not a Hugging Face model directory (config.json and *.safetensors) "
                           "nor a .gguf file")
    return path, content_hash(sorted(p for p in path.iterdir() if p.is_file()), path)


def download_prefix(url: str, into: Path, store: S3Store, progress: bool) -> Path:
    """Every object under an s3:// prefix (or the one object a key names) into a local directory."""
    bucket, prefix = split_url(url)
    objects = store.list(bucket, prefix)
    if not objects and prefix and store.exists(bucket, prefix):  # the URL names one object, e.g. a .gguf
        into.mkdir(parents=True, exist_ok=True)
        store.download(bucket, prefix, into / prefix.rsplit("/", 1)[-1])
        return into / prefix.rsplit("/", 1)[-1]
    if not objects:
        raise WeightsError(f"{url}: no objects there")
    for name in tqdm(sorted(objects), desc=f"download {url}", unit="file", disable=not progress):
        (into / name).parent.mkdir(parents=True, exist_ok=True)
        store.download(bucket, join_key(prefix, name), into / name)
    return into


def content_hash(files: list[Path], root: Path) -> str:
    """sha256 over the files' names and contents: names the source model for the snapshot fingerprint."""
    def digest(path: Path) -> str:
        h = hashlib.sha256()
        with open(path, "rb") as f:
            while block := f.read(HASH_BLOCK):
                h.update(block)
        return h.hexdigest()

    with ThreadPoolExecutor(min(8, os.cpu_count() or 2)) as pool:
        digests = list(pool.map(digest, files))
    whole = hashlib.sha256()
    for path, d in zip(files, digests):
        whole.update(f"{path.relative_to(root)}\0{d}\n".encode())
    return f"sha256:{whole.hexdigest()}"


# -- writing -----------------------------------------------------------------------------------------------

def _write_local(model_dir: Path, out: Path, dtype: str, file_bytes: int, chunk_bytes: int, hash: str,
                 source_hash: str, progress: bool, on_file: Callable[[Path], None] | None = None) -> Manifest:
    """Write the layout into the new directory `out`; `on_file` is called with each weight file once it is
    written and hashed (it may move the file away)."""
    plan = plan_weights(ModelConfig.from_dir(model_dir), dtype)
    out.mkdir(parents=True)
    groups = split_into_files(plan, file_bytes)
    files, tensors, blocks = [], [], False
    bar = tqdm(total=plan.total_bytes, desc="write layout", unit="B", unit_scale=True, disable=not progress)
    with _SafetensorsDir(model_dir) as source:
        for i, (start, end, planned) in enumerate(groups):
            name = f"weights-{i:05d}.bin"
            _write_file(out / name, start, end, planned, source, torch_dtype(dtype), bar)
            digests, device_sums = hash_chunks(out / name, chunk_bytes, hash, device_sums=start % 4 == 0)
            files.append(FileEntry(name, start, end - start, chunk_bytes, digests, device_sums))
            blocks = write_block_digests(out, plan, files[-1], hash) or blocks  # before on_file moves it away
            tensors += [TensorEntry(t.name, dtype, t.shape, name, t.offset - start, t.nbytes) for t in planned]
            if on_file is not None:
                on_file(out / name)
    bar.close()
    copied = [n for n in MODEL_FILES if (model_dir / n).is_file()]
    for name in copied:
        shutil.copyfile(model_dir / name, out / name)
    copied += [BLOCKS_FILE] if blocks else []
    digests = file_digests([out / n for n in copied], hash) if copied else {}
    manifest = Manifest(FORMAT_VERSION, dtype, plan.alignment, hash, source_hash, plan, tuple(files),
                        tuple(tensors), {n: digests[out / n] for n in copied})
    (out / MANIFEST).write_bytes(manifest.to_json())
    return manifest


def split_into_files(plan: WeightPlan, file_bytes: int) -> list[tuple[int, int, list[PlannedTensor]]]:
    """(buffer start, buffer end, tensors) per file; files break at tensor boundaries and together cover
    the whole buffer, alignment padding included."""
    groups: list[tuple[int, list[PlannedTensor]]] = []
    for t in plan.tensors:
        if not groups or t.offset - groups[-1][0] >= file_bytes:
            groups.append((t.offset, []))
        groups[-1][1].append(t)
    ends = [start for start, _ in groups[1:]] + [plan.total_bytes]
    return [(start, end, planned) for (start, planned), end in zip(groups, ends)]


def _write_file(path: Path, start: int, end: int, planned: list[PlannedTensor], source: "_SafetensorsDir",
                dtype: torch.dtype, bar: tqdm) -> None:
    with open(path, "wb") as f:
        f.truncate(end - start)  # the alignment padding stays zero
        for t in planned:
            row_bytes = t.nbytes // t.shape[0]
            for s in t.sources:
                tensor = source.get(s.name)
                if tuple(tensor.shape) != (s.rows, *t.shape[1:]):
                    raise WeightsError(f"{s.name}: shape {tuple(tensor.shape)}, expected {(s.rows, *t.shape[1:])}")
                data = tensor.to(dtype).contiguous().view(-1).view(torch.uint8).numpy()
                f.seek(t.offset - start + s.row * row_bytes)
                f.write(data)
            bar.update(t.nbytes)


def hash_chunks(path: Path, chunk_bytes: int, hash: str,
                device_sums: bool = True) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """Each chunk's digest in `hash` and (if `device_sums` and the chunks start on 4-byte boundaries) its
    device checksum, from one read of the file."""
    size = path.stat().st_size
    device_sums = device_sums and chunk_bytes % 4 == 0

    def digest(offset: int) -> tuple[str, str]:
        h, s = chunk_hasher(hash), ChunkSum()
        with open(path, "rb") as f:
            f.seek(offset)
            left = min(chunk_bytes, size - offset)
            while left:
                block = f.read(min(HASH_BLOCK, left))
                h.update(block)
                if device_sums:
                    s.update(block)
                left -= len(block)
        return h.hexdigest(), s.hexdigest()

    with ThreadPoolExecutor(min(8, os.cpu_count() or 2)) as pool:
        pairs = list(pool.map(digest, range(0, size, chunk_bytes)))
    return tuple(d for d, _ in pairs), tuple(s for _, s in pairs) if device_sums else ()


class _SafetensorsDir:
    """Tensors of a Hugging Face directory by name, whichever shard holds them."""

    def __init__(self, model_dir: Path) -> None:
        from safetensors import safe_open

        self._files = [safe_open(str(p), "pt") for p in sorted(model_dir.glob("*.safetensors"))]
        self._where = {name: f for f in self._files for name in f.keys()}
        self.model_dir = model_dir

    def get(self, name: str) -> torch.Tensor:
        if name not in self._where:
            raise WeightsError(f"{self.model_dir}: weight {name} is missing")
        return self._where[name].get_tensor(name)

    def __enter__(self) -> "_SafetensorsDir":
        return self

    def __exit__(self, *exc) -> None:
        self._files.clear()
        self._where.clear()


# -- S3 ----------------------------------------------------------------------------------------------------

def _check_out_free(out: str, store: S3Store | None) -> None:
    if is_s3(out):
        bucket, prefix = split_url(out)
        if store.exists(bucket, join_key(prefix, MANIFEST)):
            raise WeightsError(f"{out} already holds a layout")
    elif Path(out).exists():
        raise WeightsError(f"{out} already exists")


class LayoutUpload:
    """Uploads a layout's files under an s3:// prefix, the manifest last, so that a half-finished upload is
    never a valid layout; if anything fails before the manifest is up, every object it uploaded is deleted."""

    def __init__(self, url: str, store: S3Store, progress: bool = True) -> None:
        self.url = url
        self.store = store
        self.bucket, self.prefix = split_url(url)
        self._uploaded: list[str] = []
        self._bar = tqdm(desc=f"upload {url}", unit="file", disable=not progress)

    def put(self, path: Path, remove: bool = False) -> None:
        key = join_key(self.prefix, path.name)
        self.store.upload(path, self.bucket, key)
        self._uploaded.append(key)
        self._bar.update(1)
        if remove:
            path.unlink()

    def finish(self, manifest: Manifest) -> None:
        self.store.put_bytes(self.bucket, join_key(self.prefix, MANIFEST), manifest.to_json())
        self._uploaded.clear()  # a complete layout now: nothing to take back

    def __enter__(self) -> "LayoutUpload":
        return self

    def __exit__(self, *exc) -> None:
        self._bar.close()
        if self._uploaded:
            self.store.delete(self.bucket, self._uploaded)


def upload_layout(local: Path, url: str, manifest: Manifest, store: S3Store, progress: bool = True) -> None:
    """Upload a layout already built in the local directory `local`."""
    with LayoutUpload(url, store, progress) as upload:
        for name in [f.name for f in manifest.files] + list(manifest.model_files):
            upload.put(local / name)
        upload.finish(manifest)
