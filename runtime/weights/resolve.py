"""MODEL -> a local model directory the engine can build from.

| MODEL | becomes |
| --- | --- |
| a Hugging Face directory | itself (loaded by hf_dir_loader) |
| a faas-build layout directory | itself (loaded by the pipelined loader) |
| a .gguf file | a Hugging Face directory imported once into CACHE_DIR/gguf |
| s3://... holding a layout | CACHE_DIR/weights/<layout id>: its small files, and its weight files once streamed |
| s3://... holding a Hugging Face directory or one .gguf | downloaded once into CACHE_DIR/weights, then as above |

The embedded default (MODEL unset) is the bootstrap's (runtime/bootstrap.py).
"""

from __future__ import annotations

import hashlib
import os
import shutil
from pathlib import Path

import orjson

from runtime.weights.cache import DiskCache, GiB
from runtime.weights.errors import WeightsError
from runtime.weights.manifest import MANIFEST, Manifest, is_layout
from runtime.weights.s3 import S3Store, is_s3, join_key, split_url
from runtime.weights.sources import ORIGIN


def disk_cache(cache_dir: Path, cache_max_gb: float) -> DiskCache:
    return DiskCache(Path(cache_dir) / "weights", int(cache_max_gb * GiB))


def resolve_model(model: str, cache: DiskCache, store: S3Store | None = None) -> Path:
    if is_s3(model):
        return _resolve_s3(model, cache, store or S3Store())
    path = Path(model).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        return import_gguf_cached(path, cache.root.parent / "gguf")
    if is_layout(path) or (path / "config.json").is_file():
        return path
    raise WeightsError(f"MODEL={model!r} is not a Hugging Face directory, a faas-build layout, a .gguf file "
                       "or an s3:// prefix")


def import_gguf_cached(gguf: Path, root: Path) -> Path:
    from runtime.weights.layout import gguf_importer

    st = gguf.stat()
    key = hashlib.sha256(f"{gguf.resolve()}\0{st.st_size}\0{st.st_mtime_ns}".encode()).hexdigest()[:24]
    final = root / key
    if (final / "config.json").is_file():
        return final
    root.mkdir(parents=True, exist_ok=True)
    temp = root / f".{key}.tmp-{os.getpid()}"
    try:
        gguf_importer()(gguf, temp)
        os.rename(temp, final)
    finally:
        shutil.rmtree(temp, ignore_errors=True)
    return final


def _resolve_s3(url: str, cache: DiskCache, store: S3Store) -> Path:
    bucket, prefix = split_url(url)
    cache.clear_stale()
    if store.exists(bucket, join_key(prefix, MANIFEST)):
        raw = store.get_bytes(bucket, join_key(prefix, MANIFEST))
        manifest = Manifest.from_json(raw, f"{url}/{MANIFEST}")
        entry = cache.entry_dir(manifest.identity())
        small = {name: join_key(prefix, name) for name in manifest.model_files}
        _fetch_small(entry, small, bucket, store)
        _write_atomic(entry / ORIGIN, orjson.dumps({"url": url}))
        _write_atomic(entry / MANIFEST, raw)
        return entry
    return _resolve_s3_model(url, cache, store)


def _resolve_s3_model(url: str, cache: DiskCache, store: S3Store) -> Path:
    """A Hugging Face directory or a .gguf under s3://, downloaded whole into the cache (keyed by the listing,
    so a changed object is downloaded again)."""
    from runtime.weights.layout import download_prefix

    bucket, prefix = split_url(url)
    listing = store.list(bucket, prefix)
    key = hashlib.sha256(orjson.dumps([url, sorted(listing.items())])).hexdigest()[:24]
    final = cache.entry_dir(f"src-{key}")
    if final.is_dir() and all((final / name).is_file() for name in listing) and listing:
        return final if not _single_gguf(final) else import_gguf_cached(_single_gguf(final), cache.root.parent / "gguf")
    cache.root.mkdir(parents=True, exist_ok=True)
    temp = cache.root / f".src-{key}.tmp-{os.getpid()}"
    try:
        download_prefix(url, temp, store, progress=False)
        shutil.rmtree(final, ignore_errors=True)
        os.rename(temp, final)
    finally:
        shutil.rmtree(temp, ignore_errors=True)
    if gguf := _single_gguf(final):
        return import_gguf_cached(gguf, cache.root.parent / "gguf")
    if not (final / "config.json").is_file():
        raise WeightsError(f"{url} holds no faas-build layout, Hugging Face directory or .gguf file")
    return final


def _single_gguf(path: Path) -> Path | None:
    found = list(path.glob("*.gguf"))
    return found[0] if len(found) == 1 and not (path / "config.json").is_file() else None


def _fetch_small(entry: Path, names: dict[str, str], bucket: str, store: S3Store) -> None:
    entry.mkdir(parents=True, exist_ok=True)
    for name, key in names.items():
        if not (entry / name).is_file():
            _write_atomic(entry / name, store.get_bytes(bucket, key))


def _write_atomic(path: Path, data: bytes) -> None:
    temp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    temp.write_bytes(data)
    os.rename(temp, path)
