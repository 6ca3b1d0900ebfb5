"""MODEL -> a local model directory the engine can build from.

| MODEL | becomes |
| --- | --- |
| a Hugging Face directory | itself (loaded by hf_dir_loader) |
| a faas-build layout directory | itself (loaded by the pipelined loader) |
| unset | the embedded SmolLM2 GGUF, imported once (runtime/weights/embedded.py) |
| a .gguf file | a Hugging Face directory imported once into CACHE_DIR/gguf (runtime/weights/gguf_import.py) |
| s3://... holding a layout | CACHE_DIR/weights/<layout id>: its small files, and its weight files once streamed |
| s3://... holding a Hugging Face directory or one .gguf | downloaded once into CACHE_DIR/weights, then as above |
"""

from __future__ import annotations

import hashlib
import os
import shutil
from pathlib import Path

import orjson

from runtime.logs import get_logger
from runtime.weights.cache import DiskCache, GiB
from runtime.weights.errors import WeightsError
from runtime.weights.file_digest import mismatched
from runtime.weights.manifest import MANIFEST, Manifest, is_layout
from runtime.weights.s3 import S3Store, is_s3, join_key, split_url
from runtime.weights.sources import ORIGIN
from runtime.weights.temps import remove_dead_temps, temp_beside, write_atomically

log = get_logger("weights.resolve")


def disk_cache(cache_dir: Path, cache_max_gb: float) -> DiskCache:
    return DiskCache(Path(cache_dir) / "weights", int(cache_max_gb * GiB))


def resolve_model(model: str | None, cache_dir: Path, cache_max_gb: float = 100.0,
                  store: S3Store | None = None) -> Path:
    if model is None:
        from runtime.weights.embedded import embedded_model_dir

        return embedded_model_dir(cache_dir)
    if is_s3(model):
        return _resolve_s3(model, disk_cache(cache_dir, cache_max_gb), store or S3Store())
    path = Path(model).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        from runtime.weights.gguf_import import imported_model_dir

        return imported_model_dir(path, cache_dir)
    if is_layout(path) or (path / "config.json").is_file():
        return path
    raise WeightsError(f"MODEL={model!r} is not a Hugging Face directory, a faas-build layout, a .gguf file "
                       "or an s3:// prefix")


def _resolve_s3(url: str, cache: DiskCache, store: S3Store) -> Path:
    bucket, prefix = split_url(url)
    cache.clear_stale()
    if store.exists(bucket, join_key(prefix, MANIFEST)):
        raw = store.get_bytes(bucket, join_key(prefix, MANIFEST))
        manifest = Manifest.from_json(raw, f"{url}/{MANIFEST}")
        entry = cache.entry_dir(manifest.identity())
        _fetch_small(entry, manifest, url, store)
        write_atomically(entry / ORIGIN, orjson.dumps({"url": url}))
        write_atomically(entry / MANIFEST, raw)
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
        return _model_dir(final, url, cache)
    cache.root.mkdir(parents=True, exist_ok=True)
    temp = temp_beside(final)
    remove_dead_temps(final)
    try:
        download_prefix(url, temp, store, progress=False)
        shutil.rmtree(final, ignore_errors=True)
        os.rename(temp, final)
    finally:
        shutil.rmtree(temp, ignore_errors=True)
    return _model_dir(final, url, cache)


def _model_dir(downloaded: Path, url: str, cache: DiskCache) -> Path:
    found = list(downloaded.glob("*.gguf"))
    if len(found) == 1 and not (downloaded / "config.json").is_file():
        from runtime.weights.gguf_import import imported_model_dir

        return imported_model_dir(found[0], cache.root.parent)
    if not (downloaded / "config.json").is_file():
        raise WeightsError(f"{url} holds no faas-build layout, Hugging Face directory or .gguf file")
    return downloaded


def _fetch_small(entry: Path, manifest: Manifest, url: str, store: S3Store) -> None:
    """The layout's small files into its cache entry: those not there yet, and those whose cached copy fails
    its digest (discarded and fetched again, once; a copy from S3 that fails too is an error)."""
    bucket, prefix = split_url(url)
    entry.mkdir(parents=True, exist_ok=True)
    cached = {name: digest for name, digest in manifest.model_files.items() if (entry / name).is_file()}
    damaged = set(mismatched(entry, cached, manifest.hash))
    for name in sorted(damaged):
        log.warning("disk cache: %s fails its digest; discarded and fetched again from %s", entry / name, url)
    for name in manifest.model_files:
        if name in damaged or not (entry / name).is_file():
            write_atomically(entry / name, store.get_bytes(bucket, join_key(prefix, name)))
    bad = mismatched(entry, manifest.model_files, manifest.hash)
    if bad:
        raise WeightsError(f"{url}: {bad[0]} as stored there does not match the layout's manifest: the layout "
                           "was changed after it was built")
