"""Weight loading bandwidth: this loader beside the usual ways and beside the machine's limits, in one run.

For each shape (a random-weight model of a real shape, scripts/model_shapes.py), GiB/s of:
  parallel_read   the layout files read by 16 threads at once (64 MiB preadv) and thrown away: the same
                  files, read without the loader; measured in turns with `loader` (read, loader, read, ...),
                  so their ratio compares the same moments
  pinned_copy     pinned host memory -> GPU, 256 MiB copies (GPU only)
  loader          runtime/weights/loader.py into the engine's flat buffer, as the engine runs it: on a GPU
                  each chunk checked there once it lands (device checksums), on CPU hashed on the host.
                  Timed like the engine's weights stage, from the load call until every chunk is verified;
                  the LayoutLoader (its manifest read) and the buffer are made before, as in the engine
                  (their time, once: `made_s`; it includes starting the reader threads). Pieces are read
                  by the native reader (runtime/weights/native_reader.c) where it was built
  loader_python   the same with every piece read from Python (LoaderOptions.native=False), in the same turns
  loader_host_xxh3-128  the same with the chunks hashed on the host (LoaderOptions.verify_on_device=False),
                  each whole piece after it is read; loader_hash_windows hashing 1 MiB windows as they are read
  loader_nohash   the same without verification: what verifying costs (page cache only)
  loader_host_blake3  hashed on the host from a layout built with --hash blake3, and loader_host_sha256
                  with --hash sha256 (--compare-hashes; each built, measured and deleted before the next)
  safetensors     safetensors load_file, then .to(device), tensor by tensor
  transformers    AutoModelForCausalLM.from_pretrained(dtype=bfloat16) then .to(device) (page cache only)
  loader_s3       the loader from a moto S3 server on loopback (--s3-shapes), then again from the disk cache
  loader_driver   the loader through the driver API with no torch (DriverSink), as the CUDA restore helper
                  streams a gpu snapshot's weights during the restore (GPU only)
  --sweep         the loader (verified) over a grid of reader threads x read size x pinned slots per reader
each from the page cache (warm) and, as root, from cold disk (echo 3 > /proc/sys/vm/drop_caches first; the
parallel read and the loaders in --cold-repeat rounds in turns, the others once).
Prints a table and writes JSON to --out.

    python scripts/bench_weights.py --shapes qwen2-1.5b llama-3-8b --out /tmp/bench-weights.json
    python scripts/bench_weights.py --device cpu --shapes tiny --out /tmp/w.json   # a check without a GPU
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import platform
import shutil
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from runtime.weights.layout import write_layout  # noqa: E402
from runtime.bench.disk_read import read_files as parallel_read  # noqa: E402
from runtime.bench.page_cache import drop_page_cache  # noqa: E402
from runtime.weights.loader import LoaderOptions, LayoutLoader  # noqa: E402
from runtime.weights.manifest import DEFAULT_HASH, HASHES, Manifest  # noqa: E402

GiB, MiB = 1 << 30, 1 << 20


def drop_caches() -> bool:
    return drop_page_cache() is None


def settle() -> None:
    """Write back what building the models and layouts left dirty in the page cache: while the kernel writes
    GiBs back, loads measured beside it are slower than the parallel read measured apart from it, and nothing in a
    deployed image is being written back when the runtime starts."""
    t = time.perf_counter()
    os.sync()
    print(f"  (sync: {time.perf_counter() - t:.1f}s)", flush=True)


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def timed(fn, nbytes: int, device: str) -> float:
    """GiB/s of one call of fn."""
    sync(device)
    t = time.perf_counter()
    fn()
    sync(device)
    return nbytes / (time.perf_counter() - t) / GiB


def read_files(paths: list[Path]) -> None:
    """The parallel read: 16 threads, preadv of 64 MiB into reused buffers, data thrown away."""
    parallel_read(paths, 16)


def h2d_limit(device: str) -> float | None:
    if device != "cuda":
        return None
    host = torch.empty(256 * MiB, dtype=torch.uint8, pin_memory=True)
    dev = torch.empty(256 * MiB, dtype=torch.uint8, device="cuda")
    dev.copy_(host)
    return timed(lambda: [dev.copy_(host, non_blocking=True) for _ in range(32)], 32 * 256 * MiB, device)


def prepared_load(layout: Path, device: str, options: LoaderOptions, cache=None):
    """One load as the engine's weights stage runs it: the loader made (its manifest read, in Engine.build)
    and the weight buffer allocated (Engine.start) before it; what a call of the returned function times is
    the load, from the call to wait() returning with every chunk verified."""
    load = LayoutLoader(layout, options, cache=cache)
    buffer = torch.empty(load.manifest.total_bytes, dtype=torch.uint8, device=device)
    return lambda: load(load.manifest.plan, buffer).wait()


def prepared_driver_load(layout: Path, options: LoaderOptions):
    """As the restore helper loads: LocalFile sources, a DriverSink over device memory, no torch in the path
    (the manifest read and the memory allocated before, as prepared_load)."""
    from cuda.bindings import driver

    from runtime.weights.loader import WeightStream
    from runtime.cuda_driver import call
    from runtime.weights.sinks import DriverSink
    from runtime.weights.sources import LocalFile

    manifest = Manifest.read(layout)
    buffer = torch.empty(manifest.total_bytes, dtype=torch.uint8, device="cuda")
    context = call(driver.cuCtxGetCurrent(), "cuCtxGetCurrent")

    def load() -> None:
        sources = [LocalFile(layout / f.name) for f in manifest.files]
        WeightStream(manifest, sources, DriverSink(buffer.data_ptr(), manifest.total_bytes, context), options,
                     str(layout)).wait()

    return load


def sweep(layout: Path, files: list[Path], nbytes: int, device: str, repeat: int) -> list[dict]:
    rows = []
    for threads in (8, 16, 24):
        for read_mb in (8, 16, 64):
            for slots in (2, 4):
                options = LoaderOptions(threads=threads, read_bytes=read_mb * MiB, slots_per_thread=slots)
                row = warm_and_cold(f"t{threads} r{read_mb} s{slots}", prepared_load(layout, device, options),
                                    files, nbytes, device, repeat, False)
                rows.append({"threads": threads, "read_mb": read_mb, "slots": slots, **row})
    return rows


def load_safetensors(model_dir: Path, device: str) -> None:
    from safetensors.torch import load_file

    for path in sorted(model_dir.glob("*.safetensors")):
        tensors = {k: v.to(device) for k, v in load_file(path).items()}
        del tensors


def load_transformers(model_dir: Path, device: str) -> None:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16).to(device)
    del model


def warm_and_cold(name: str, fn, files: list[Path], nbytes: int, device: str, repeat: int, cold: bool) -> dict:
    read_files(files)  # into the page cache
    fn()  # and one unmeasured run (allocator, pinned pool, imports)
    warm = [timed(fn, nbytes, device) for _ in range(repeat)]
    row = {"warm_gib_s": round(statistics.median(warm), 2), "warm_runs": [round(x, 2) for x in warm]}
    if cold and drop_caches():
        row["cold_gib_s"] = round(timed(fn, nbytes, device), 2)
    print(f"  {name:<16} {row}", flush=True)
    return row


def in_turns(fns: dict, files: list[Path], nbytes: int, device: str, repeat: int, cold_repeat: int) -> dict[str, dict]:
    """As warm_and_cold, for several modes measured in turns (a, b, a, b, ...): the parallel read moved by 10-20%
    between blocks of runs on the H100 machine, and a ratio of two modes taken in different blocks moved with
    it. Cold runs (page cache dropped before each) are taken in turns too, `cold_repeat` rounds. Also the median
    of the per-round ratios of each mode to the first."""
    read_files(files)
    for fn in fns.values():
        fn()
    warm = _rounds(fns, nbytes, device, repeat, drop=False)
    cold = _rounds(fns, nbytes, device, cold_repeat, drop=True) if cold_repeat and drop_caches() else {}
    rows = {}
    for name in fns:
        rows[name] = {"warm_gib_s": round(statistics.median(warm[name]), 2),
                      "warm_runs": [round(x, 2) for x in warm[name]], **_of_first(warm, name, "")}
        if cold:
            rows[name] |= {"cold_gib_s": round(statistics.median(cold[name]), 2),
                           "cold_runs": [round(x, 2) for x in cold[name]], **_of_first(cold, name, "cold_")}
        print(f"  {name:<16} {rows[name]}", flush=True)
    return rows


def _rounds(fns: dict, nbytes: int, device: str, rounds: int, drop: bool) -> dict[str, list[float]]:
    runs: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(rounds):
        for name, fn in fns.items():
            if drop:
                drop_caches()
            runs[name].append(timed(fn, nbytes, device))
    return runs


def _of_first(runs: dict[str, list[float]], name: str, prefix: str) -> dict:
    first = next(iter(runs.values()))
    return {f"{prefix}of_first_in_turn": round(statistics.median(x / f for x, f in zip(runs[name], first)), 3)}


def bench_s3(model_dir: Path, device: str, options: LoaderOptions, work: Path, file_mb: int) -> dict:
    """moto's server reads an object's whole value, under a lock, for every ranged GET, so a GET costs the
    object's size: the S3 copy of the layout is built with small files (`--s3-file-mb`) for this row to finish
    in seconds. It still measures moto, not S3; what it shows is the path working at this model's scale."""
    from moto.server import ThreadedMotoServer

    from runtime.weights.layout import upload_layout
    from runtime.weights.resolve import disk_cache, resolve_model
    from runtime.weights.s3 import S3Store

    logging.getLogger("werkzeug").setLevel(logging.ERROR)
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    os.environ.update(AWS_ENDPOINT_URL=f"http://{host}:{port}", AWS_ACCESS_KEY_ID="bench",
                      AWS_SECRET_ACCESS_KEY="bench", AWS_DEFAULT_REGION="us-east-1")
    layout = work / "s3-layout"
    try:
        write_layout(str(model_dir), str(layout), dtype="bfloat16", file_bytes=file_mb * MiB, progress=False)
        store = S3Store()
        store.client.create_bucket(Bucket="bench")
        manifest = Manifest.read(layout)
        upload_layout(layout, "s3://bench/layout", manifest, store, progress=False)
        cache = disk_cache(work / "s3-cache", 1000.0)
        shutil.rmtree(cache.root, ignore_errors=True)
        entry = resolve_model("s3://bench/layout", cache.root.parent, 1000.0, store)
        load = prepared_load(entry, device, options, cache)
        row = {"s3_gib_s": round(timed(load, manifest.total_bytes, device), 2)}
        row["disk_cache_gib_s"] = round(timed(load, manifest.total_bytes, device), 2)
    finally:
        server.stop()
        shutil.rmtree(layout, ignore_errors=True)
    row["s3_file_mb"] = file_mb
    print(f"  {'loader_s3':<16} {row}", flush=True)
    return row


def bench_shape(shape: str, args, work: Path) -> dict:
    from scripts.model_shapes import make_random_model_dir

    device = args.device
    model_dir = make_random_model_dir(work / shape, shape)
    layout = work / f"{shape}-layout"
    if (layout / "manifest.json").exists() and Manifest.read(layout).hash != DEFAULT_HASH:
        shutil.rmtree(layout)  # left by a run from before the default changed
    if not (layout / "manifest.json").exists():
        t = time.perf_counter()
        write_layout(str(model_dir), str(layout), dtype="bfloat16", progress=False)
        print(f"{shape}: layout built in {time.perf_counter() - t:.1f}s", flush=True)
    settle()
    manifest = Manifest.read(layout)
    nbytes = manifest.total_bytes
    files = [layout / f.name for f in manifest.files]
    st_files = sorted(model_dir.glob("*.safetensors"))
    st_bytes = sum(p.stat().st_size for p in st_files)
    options = LoaderOptions(threads=args.threads)
    if args.read_mb:
        options = dataclasses.replace(options, read_bytes=args.read_mb * MiB)
    print(f"{shape}: {nbytes / GiB:.2f} GiB in {len(files)} files", flush=True)
    cold = not args.no_cold
    result = {"shape": shape, "bytes": nbytes, "files": len(files), "pinned_copy_gib_s": h2d_limit(device)}
    if result["pinned_copy_gib_s"] is not None:
        result["pinned_copy_gib_s"] = round(result["pinned_copy_gib_s"], 2)
        print(f"  {'pinned_copy':<16} {result['pinned_copy_gib_s']}", flush=True)
    t = time.perf_counter()
    load = prepared_load(layout, device, options)
    made_s = round(time.perf_counter() - t, 4)  # the manifest read, readers started, buffer allocated: not timed
    from_python = prepared_load(layout, device, dataclasses.replace(options, native=False))
    result |= in_turns({"parallel_read": lambda: read_files(files), "loader": load, "loader_python": from_python},
                       files, nbytes, device, args.repeat, args.cold_repeat if cold else 0)
    result["loader"]["made_s"] = made_s
    del load, from_python  # their weight buffers
    host = dataclasses.replace(options, verify_on_device=False)
    name = f"loader_host_{DEFAULT_HASH}"
    result[name] = warm_and_cold(name, prepared_load(layout, device, host), files, nbytes, device, args.repeat,
                                 False)
    if device == "cuda":
        result["loader_driver"] = warm_and_cold("loader_driver", prepared_driver_load(layout, options), files,
                                                nbytes, device, args.repeat, False)
    windows = dataclasses.replace(host, hash_window_bytes=MiB)  # each piece read and hashed 1 MiB at a time
    result["loader_hash_windows"] = warm_and_cold("loader_hash_windows", prepared_load(
        layout, device, windows), files, nbytes, device, args.repeat, False)
    if args.sweep:
        result["sweep"] = sweep(layout, files, nbytes, device, args.repeat)
    unverified = dataclasses.replace(options, verify=False)
    result["loader_nohash"] = warm_and_cold("loader_nohash", prepared_load(layout, device, unverified), files,
                                            nbytes, device, args.repeat, False)
    result["safetensors"] = warm_and_cold("safetensors", lambda: load_safetensors(model_dir, device), st_files,
                                          st_bytes, device, args.repeat, cold)
    if not args.no_transformers:
        result["transformers"] = warm_and_cold("transformers", lambda: load_transformers(model_dir, device),
                                               st_files, st_bytes, device, 1, False)
    if shape in args.s3_shapes:
        result["loader_s3"] = bench_s3(model_dir, device, options, work, args.s3_file_mb)
    for hash in args.compare_hashes:  # one extra layout on disk at a time (an 8B one is 15 GiB)
        other = work / f"{shape}-layout-{hash}"
        shutil.rmtree(other, ignore_errors=True)
        write_layout(str(model_dir), str(other), dtype="bfloat16", hash=hash, progress=False)
        settle()
        other_files = [other / f.name for f in manifest.files]
        result[f"loader_host_{hash}"] = warm_and_cold(f"loader_host_{hash}", prepared_load(other, device, host),
                                                      other_files, nbytes, device, args.repeat, cold)
        shutil.rmtree(other)
    if args.cleanup:
        for path in (model_dir, layout, work / "s3-cache"):
            shutil.rmtree(path, ignore_errors=True)
    return result


def _percent(x: float | None) -> str:
    return "-" if x is None else f"{x:.0%}"


def table(results: list[dict]) -> str:
    by_hash = [f"loader_host_{h}" for h in HASHES]
    rows = [f"{'shape':<12} {'GiB':>6} | {'16-thr read':>14} {'pinned':>7} | {'loader':>12} {'python':>12} | "
            + " ".join(f"{'host ' + h:>12}" for h in HASHES) + f" {'window':>6} {'no hash':>7} | {'safetensors':>14} "
            f"{'transformers':>12} | {'s3':>6} {'s3->cache':>9} | {'loader/read':>12} {'per round':>9} "
            f"{'cold, per':>9}"]

    def wc(row: dict | None) -> str:
        if not row:
            return "-"
        return f"{row['warm_gib_s']}/{row.get('cold_gib_s', '-')}"

    for r in results:
        limit = min(x for x in (r["parallel_read"]["warm_gib_s"], r["pinned_copy_gib_s"]) if x)
        s3 = r.get("loader_s3", {})
        rows.append(f"{r['shape']:<12} {r['bytes'] / GiB:6.2f} | {wc(r['parallel_read']):>14} "
                    f"{r['pinned_copy_gib_s'] or '-':>7} | {wc(r['loader']):>12} {wc(r.get('loader_python')):>12} | "
                    + " ".join(f"{wc(r.get(k)):>12}" for k in by_hash)
                    + f" {r['loader_hash_windows']['warm_gib_s']:>6} {r['loader_nohash']['warm_gib_s']:>7} | "
                    f"{wc(r['safetensors']):>14} "
                    f"{wc(r.get('transformers')):>12} | {s3.get('s3_gib_s', '-'):>6} "
                    f"{s3.get('disk_cache_gib_s', '-'):>9} | {r['loader']['warm_gib_s'] / limit:12.0%} "
                    f"{r['loader']['of_first_in_turn']:9.0%} {_percent(r['loader'].get('cold_of_first_in_turn')):>9}")
    return "\n".join(rows) + (
        "\n(GiB/s, warm page cache / cold disk. loader: as the engine runs it (on a GPU, checked there); python: "
        "the same, read from Python; host: "
        "hashed on the host with each chunk hash, piece by piece; window: host "
        f"{DEFAULT_HASH} in 1 MiB windows as each piece is read; no hash: unverified (warm); loader/read: warm "
        "loader against min(16-thread read, pinned copy); per round: median of loader/read over the rounds taken in "
        "turns, warm and cold)")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shapes", nargs="+", default=["qwen2-1.5b", "llama-3-8b"])
    p.add_argument("--s3-shapes", nargs="*", default=["qwen2-1.5b", "tiny"], help="shapes also loaded from moto")
    p.add_argument("--s3-file-mb", type=int, default=64, help="file size of the layout copy put in moto (see bench_s3)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--work", type=Path, default=Path("/tmp/bench-weights"))
    p.add_argument("--threads", type=int, default=0, help="loader reader threads (0: one per core, at most 16)")
    p.add_argument("--read-mb", type=int, default=0, help="loader read size, one pinned slot (0: the loader's own)")
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--sweep", action="store_true", help="also the loader over threads x read size x slots")
    p.add_argument("--no-cold", action="store_true")
    p.add_argument("--cold-repeat", type=int, default=3,
                   help="cold rounds of the parallel read and the loaders, in turns")
    p.add_argument("--no-transformers", action="store_true")
    others = [h for h in HASHES if h != DEFAULT_HASH]
    p.add_argument("--compare-hashes", nargs="*", default=others, choices=others, metavar="HASH",
                   help=f"also time layouts built with these chunk hashes (default: {' '.join(others)}; none: "
                        "the flag alone)")
    p.add_argument("--cleanup", action="store_true", help="delete each shape's files once it is measured")
    p.add_argument("--out", type=Path, default=Path("bench-weights.json"))
    args = p.parse_args()
    args.work.mkdir(parents=True, exist_ok=True)
    machine = {"device": torch.cuda.get_device_name() if args.device == "cuda" else platform.processor() or "cpu",
               "cpus": os.cpu_count(), "torch": torch.__version__, "date": time.strftime("%Y-%m-%d %H:%M UTC",
                                                                                         time.gmtime())}
    results = []
    for shape in args.shapes:
        results.append(bench_shape(shape, args, args.work))
        args.out.write_text(json.dumps({"machine": machine, "command": sys.argv, "results": results}, indent=2))
    print(table(results))


if __name__ == "__main__":
    main()
