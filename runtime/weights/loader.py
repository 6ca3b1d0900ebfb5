"""The pipelined loader of a faas-build layout: an engine `LoadWeights` that returns at once.

Reader threads (runtime/weights/readers.py: kept for the process, started when the loader is made) take the
work in buffer order: `read_bytes` pieces (preadv from disk, or ranged GETs from S3), each read into the
reader's own ring of pinned host buffers and copied to the GPU on its own side stream; a slot is reused only
once its copy's event has completed. On CPU the pieces are read straight into the weight buffer (no pinned
memory, no stream, no copy).

Every chunk is verified before `wait()` returns. From local files into a CUDA buffer the GPU does it: once a
group's chunks have landed, a kernel computes their device checksums (runtime/weights/device_checksum.py), so
the host reads each byte once. Otherwise (S3, the CPU, the torch-free restore helper, layouts without device
checksums) the readers hash each piece as it lands (xxhash, blake3 and hashlib release the GIL on large
buffers, so hashing scales with the readers). A chunk that fails its check fails the load with an error
naming the file: the model is never used half-wrong.

`wait_tensor(name)` returns as soon as that tensor's chunks are in place, so a caller may use the first
layers while the last ones stream; `wait()` is the end of the whole load. A load may be a subset of the
chunks (`only`): a multi-model pool (runtime/pool) streams back just the groups of a model it had evicted,
verified as a whole load is.
"""

from __future__ import annotations

import bisect
import dataclasses
import os
import queue
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from runtime.engine.weight_plan import WeightPlan
from runtime.logs import get_logger
from runtime.weights.cache import DiskCache
from runtime.weights.errors import WeightsError
from runtime.weights.manifest import FileEntry, Manifest, check_model_files, chunk_hasher
from runtime.weights.readers import READERS
from runtime.weights.s3 import S3Store

if TYPE_CHECKING:
    import torch

    from runtime.weights.sinks import Sink, Writer

log = get_logger("weights.loader")

MiB = 1 << 20


@dataclass(frozen=True)
class LoaderOptions:
    threads: int = 0  # 0: one per core, at most 16
    # a piece: one work item; from Python one preadv / ranged GET into one pinned slot. Each costs a few
    # hand-overs of the GIL, so pieces are large (docs/weights.md). The native reader takes a piece in one
    # call, in native_slot_bytes steps
    read_bytes: int = 16 * MiB
    slots_per_thread: int = 2  # read the next piece while the last one is copied
    # Pieces not hashed on the host are read from local files by the native reader where it was built
    # (runtime/weights/native_reader.py); on a GPU through its own ring of slots_per_thread pinned slots of
    # native_slot_bytes: small, so that a slot is still in the CPU's cache when the copy engine reads it
    native: bool = True
    native_slot_bytes: int = 4 * MiB
    verify: bool = True  # hash every chunk; off only to measure what it costs (scripts/bench_weights.py)
    # From local files into a CUDA buffer, check the chunks on the GPU once they land (device checksums,
    # runtime/weights/device_checksum.py) instead of hashing them on the host; False: always on the host
    verify_on_device: bool = True
    # Hashed on the host, from local files, a piece may be read and hashed in windows of this size, each while
    # it is still in the core's cache (0: whole pieces). Each window costs two hand-overs of the GIL, which
    # on the H100 machines cost more than the cache saved
    hash_window_bytes: int = 0

    def reader_threads(self, n_chunks: int) -> int:
        auto = min(16, os.cpu_count() or 4)
        return max(1, min(self.threads or auto, n_chunks))


@dataclass(frozen=True)
class Chunk:
    file: int  # index into the manifest's files
    index: int  # within the file
    offset: int  # within the file
    length: int
    buffer_offset: int
    digest: str


@dataclass
class TierStats:
    bytes: int = 0
    start: float = float("inf")
    end: float = 0.0

    def add(self, n: int, start: float, end: float) -> None:
        self.bytes += n
        self.start, self.end = min(self.start, start), max(self.end, end)

    def as_detail(self) -> dict:
        seconds = max(self.end - self.start, 1e-9)
        return {"bytes": self.bytes, "seconds": round(seconds, 4), "gib_s": round(self.bytes / seconds / 2**30, 3)}


def layout_chunks(manifest: Manifest) -> list[Chunk]:
    return [Chunk(i, j, off, n, f.buffer_offset + off, f.digests[j])
            for i, f in enumerate(manifest.files) for j, (off, n) in enumerate(f.chunks())]


def readers_for(manifest: Manifest, options: LoaderOptions) -> int:
    """How many reader threads a load of local files takes."""
    return options.reader_threads(sum(-(-n // options.read_bytes) for f in manifest.files for _, n in f.chunks()))


def check_plan(manifest: Manifest, plan: WeightPlan, where: str) -> None:
    if manifest.dtype != plan.dtype:
        raise WeightsError(f"{where}: the layout holds {manifest.dtype} weights, the engine wants {plan.dtype} "
                           f"(set DTYPE={manifest.dtype} or rebuild the layout with --dtype {plan.dtype})")
    if manifest.plan != plan:
        raise WeightsError(f"{where}: the layout was built for another weight plan (model or runtime version)")


class CorruptChunks(WeightsError):
    """Chunks failed their check; `files` are the indices (in the manifest) of the files they are in."""

    def __init__(self, message: str, files: frozenset[int]) -> None:
        super().__init__(message)
        self.files = files


class WeightStream:
    """One load in flight: the object `LoadWeights` returns."""

    def __init__(self, manifest: Manifest, sources: list, sink: "Sink", options: LoaderOptions,
                 where: str, only: frozenset[int] | None = None) -> None:
        """SINK: where the bytes go (runtime/weights/sinks.py); ONLY: the chunks to load (layout_chunks
        indices), None for all."""
        self.manifest = manifest
        self.only = only
        self.sources = sources
        self.sink = sink
        self.options = options
        self.where = where
        self.chunks = layout_chunks(manifest)
        self._starts = [c.buffer_offset for c in self.chunks]
        self._landed = [threading.Event() for _ in self.chunks]
        self._copied: list[list] = [[] for _ in self.chunks]
        self.device_check = self._device_check()
        self.verified = "off" if not options.verify else "device" if self.device_check else "host"
        # how pieces are read: those hashed on the host, and S3's, pass through Python
        native = options.native and sink.native and self.verified != "host"
        self.reads = "native" if native and any(s.tier == "disk" for s in sources) else "python"
        self._todo: queue.SimpleQueue = queue.SimpleQueue()
        self._pieces_left = self._queue_work()
        self._error: BaseException | None = None
        self._stats: dict[str, TierStats] = {}
        self._lock = threading.Lock()
        self._finished = False
        self._first_landed: float | None = None
        self._ring_s = 0.0  # the longest a reader took to pin its ring: before its first read
        self.started = time.time()
        self._readers = READERS.run(self._reader, options.reader_threads(self._todo.qsize()))

    def _queue_work(self) -> list[int]:
        """Queue the work in buffer order and return each chunk's number of pieces. A chunk hashed on the host
        is one item (its pieces must pass through one hash in order); otherwise every piece is an item of its
        own, so that the readers finish together (with 64 MiB chunks, a 3 GiB model's last round of chunks
        kept a few readers busy for ~30 ms while the others idled)."""
        step = self.options.read_bytes
        pieces = [list(range(0, c.length, step)) if self.only is None or i in self.only else []
                  for i, c in enumerate(self.chunks)]
        for i, offsets in enumerate(pieces):
            if not offsets:
                self._landed[i].set()  # not part of this load: already in place
                continue
            for item in [offsets] if self.verified == "host" else [[o] for o in offsets]:
                self._todo.put((i, item))
        return [len(offsets) for offsets in pieces]

    def _device_check(self):
        """A DeviceCheck where the chunks can be verified on the GPU: a sink that supports it, every file
        local (an S3 download is verified before it goes to the disk cache), checksums in the manifest."""
        if not (self.options.verify and self.options.verify_on_device and self.manifest.has_device_sums
                and all(source.tier == "disk" for source in self.sources)):
            return None
        return self.sink.device_check(self.manifest, self.only)

    # -- the caller's side -------------------------------------------------------------------------

    def wait_tensor(self, name: str) -> None:
        """Block until the planned tensor `name` is in the weight buffer (and, on the GPU, make the current
        stream wait for its copies)."""
        t = self.manifest.plan.by_name()[name]
        first = bisect.bisect_right(self._starts, t.offset) - 1
        last = bisect.bisect_left(self._starts, t.offset + t.nbytes)
        for i in range(first, last):
            while not self._landed[i].wait(0.05):
                self._raise_if_failed()
            self._raise_if_failed()
            self.sink.wait_copies(self._copied[i])

    def wait(self) -> "WeightStream":
        self._readers.wait()
        if self._finished:
            self._raise_if_failed()
            return self
        self._finished = True
        for source in self.sources:  # cache files are renamed into place only if every chunk was verified
            source.close(self._error is None)
        self._raise_if_failed()  # every copy has landed: each reader's writer.close() waited for its own
        if self.device_check is not None:
            self._raise_if_corrupt([(f, j, "device checksum") for f, j in self.device_check.mismatches()])
        self._report()
        return self

    @property
    def bytes(self) -> int:
        """The bytes this load streams."""
        return sum(c.length for i, c in enumerate(self.chunks) if self.only is None or i in self.only)

    def tier_stats(self) -> dict[str, dict]:
        return {tier: s.as_detail() for tier, s in self._stats.items()}

    def detail(self) -> dict:
        """For the weights stage: each tier's bytes and rate, how chunks were verified and read, how long
        after the load began its first chunk landed, and the longest a reader took to pin its ring."""
        first = None if self._first_landed is None else round(self._first_landed - self.started, 4)
        return {"tiers": self.tier_stats(), "verified": self.verified, "reads": self.reads,
                "first_landed_s": first, "ring_s": round(self._ring_s, 4)}

    # -- the readers -------------------------------------------------------------------------------

    def _reader(self) -> None:
        try:
            slot_bytes = min(self.options.read_bytes, max(c.length for c in self.chunks))
            writer = self.sink.writer(slot_bytes, self.options.slots_per_thread,
                                      self.options.native_slot_bytes if self.reads == "native" else 0)
            try:
                while self._error is None:
                    try:
                        i, offsets = self._todo.get_nowait()
                    except queue.Empty:
                        break
                    self._load_pieces(i, offsets, writer)
            finally:
                writer.close()  # its copies have left its slots: they may be reused
                with self._lock:
                    self._ring_s = max(self._ring_s, writer.ring_s)
        except BaseException as exc:  # noqa: BLE001 - handed to wait()
            with self._lock:
                self._error = self._error or exc

    def _load_pieces(self, i: int, offsets: list[int], writer: "Writer") -> None:
        """Pieces of chunk `i` at these offsets in it; all of them, in order, when it is hashed here."""
        chunk = self.chunks[i]
        source = self.sources[chunk.file]
        digest = chunk_hasher(self.manifest.hash) if self.verified == "host" else None
        start = time.time()
        copies, nbytes = [], 0
        for off in offsets:
            n = min(self.options.read_bytes, chunk.length - off)
            nbytes += n
            dst = chunk.buffer_offset + off
            if digest is None:
                copied = writer.read_from(source, chunk.offset + off, dst, n)
            else:
                copied = self._read_hashed(source, chunk.offset + off, dst, n, writer, digest)
            if copied is not None:
                copies.append(copied)
        if digest is not None and digest.hexdigest() != chunk.digest:
            self._raise_if_corrupt([(chunk.file, chunk.index, self.manifest.hash)])
        with self._lock:
            for event in copies:  # a writer records its events again for later pieces: each is waited on once
                if not any(event is seen for seen in self._copied[i]):
                    self._copied[i].append(event)
            self._pieces_left[i] -= len(offsets)
            landed = self._pieces_left[i] == 0
            if landed and self._first_landed is None:
                self._first_landed = time.time()
            self._stats.setdefault(source.tier, TierStats()).add(nbytes, start, time.time())
        if not landed:
            return
        source.chunk_verified(chunk.index)
        self._landed[i].set()
        if self.device_check is not None:  # usable now; checked with its group, before wait() returns
            self.device_check.chunk_landed(i, self._copied[i])

    def _read_hashed(self, source, offset: int, dst: int, n: int, writer: "Writer", digest) -> object | None:
        piece = writer.slot(dst, n)
        # one read per piece unless windows are asked for: each read hands the GIL back and forth
        window = min(self.options.hash_window_bytes or n, n) if source.small_reads else n
        for w in range(0, n, window):
            part = piece[w:w + window]
            source.read_into(offset + w, part)
            digest.update(part)
        return writer.commit(dst, n)

    def _raise_if_corrupt(self, bad: list[tuple[int, int, str]]) -> None:
        """(file, chunk, check) of each chunk that failed its check."""
        if not bad:
            return
        file, index, check = bad[0]
        entry: FileEntry = self.manifest.files[file]
        offset, length = entry.chunks()[index]
        more = f" (and {len(bad) - 1} more chunks)" if len(bad) > 1 else ""
        raise CorruptChunks(f"{self.where}: {entry.name} chunk {index} (bytes {offset}-{offset + length}) fails its "
                            f"{check} check{more}: the layout is corrupt or was changed after it was built",
                            frozenset(f for f, _, _ in bad))

    def _raise_if_failed(self) -> None:
        if self._error is not None:
            if isinstance(self._error, CorruptChunks):
                raise CorruptChunks(str(self._error), self._error.files)
            if isinstance(self._error, WeightsError):
                raise WeightsError(str(self._error))
            raise WeightsError(f"{self.where}: {type(self._error).__name__}: {self._error}") from self._error

    def _report(self) -> None:
        seconds = time.time() - self.started
        total = self.bytes
        log.info("weights: %.2f GiB in %.3fs (%.2f GiB/s, verified: %s, reads: %s) %s", total / 2**30, seconds,
                 total / max(seconds, 1e-9) / 2**30, self.verified, self.reads,
                 " ".join(f"{k}={v['gib_s']}GiB/s" for k, v in self.tier_stats().items()))


def stream_layout(manifest: Manifest, sources: list, plan: WeightPlan, buffer: "torch.Tensor",
                  options: LoaderOptions, where: str, only: frozenset[int] | None = None) -> WeightStream:
    from runtime.weights.sinks import HostSink, TorchCudaSink

    check_plan(manifest, plan, where)
    if buffer.numel() < manifest.total_bytes:
        raise WeightsError(f"{where}: weight buffer of {buffer.numel()} bytes, the layout has {manifest.total_bytes}")
    sink = TorchCudaSink(buffer) if buffer.device.type == "cuda" else HostSink(buffer)
    return WeightStream(manifest, sources, sink, options, where, only)


class LayoutLoader:
    """A LoadWeights for a faas-build layout directory. Weight files missing from it are streamed from the
    layout's origin (origin.json: the s3:// prefix it was cached from), filling `cache` on the way. The
    manifest is read once, here: the engine takes its dtype from it before the load."""

    def __init__(self, layout_dir: Path, options: LoaderOptions | None = None, cache: DiskCache | None = None,
                 store: S3Store | None = None) -> None:
        self.layout_dir = Path(layout_dir)
        self.manifest = Manifest.read(self.layout_dir)
        check_model_files(self.layout_dir, self.manifest)  # before the engine reads its config and tokenizer
        self.options = options or LoaderOptions()
        READERS.start(readers_for(self.manifest, self.options))  # off the load's path
        self.cache = cache
        self.store = store

    def __call__(self, plan: WeightPlan, buffer: "torch.Tensor",
                 only: frozenset[int] | None = None) -> "WeightStream | _RefetchingStream":
        """Stream the layout into BUFFER; ONLY: just these chunks (layout_chunks indices)."""
        stream = self._stream(plan, buffer, only)
        cached = {i for i, s in enumerate(stream.sources) if s.tier == "disk"} if self.cache is not None else set()
        return _RefetchingStream(self, stream, plan, buffer, only, cached) if cached else stream

    def _stream(self, plan: WeightPlan, buffer: "torch.Tensor", only: frozenset[int] | None) -> WeightStream:
        from runtime.weights.sources import open_sources

        s3 = self.store or S3Store()  # boto3 is imported only if a file is streamed from S3
        sources = open_sources(self.layout_dir, self.manifest, self.cache, s3)
        options = self.options
        if any(source.tier == "s3" for source in sources):  # S3 settings: GETs in flight and their size
            options = dataclasses.replace(options, threads=s3.options.concurrency, read_bytes=s3.options.part_bytes)
        try:
            return stream_layout(self.manifest, sources, plan, buffer, options, str(self.layout_dir), only)
        except BaseException:
            for source in sources:
                source.close(False)
            raise


class _RefetchingStream:
    """A load that read files from the disk cache (a layout cached from S3): if a cached file fails its check,
    it is discarded and the load runs again, that file streamed from S3 this time, once; a copy from S3 that
    fails too is an error. Anything else is the first load's own."""

    def __init__(self, loader: LayoutLoader, stream: WeightStream, plan: WeightPlan, buffer: "torch.Tensor",
                 only: frozenset[int] | None, cached: set[int]) -> None:
        self.loader, self.stream, self.plan, self.buffer, self.only, self.cached = \
            loader, stream, plan, buffer, only, cached

    def __getattr__(self, name: str):
        return getattr(self.stream, name)

    def wait(self) -> WeightStream:
        try:
            return self.stream.wait()
        except CorruptChunks as exc:
            if not exc.files <= self.cached:
                raise
            bad = [self.loader.manifest.files[f].name for f in sorted(exc.files)]
            for name in bad:
                (self.loader.layout_dir / name).unlink(missing_ok=True)
            log.warning("disk cache: %s failed its check (%s); discarded and streamed again from S3",
                        ", ".join(bad), exc)
            # the whole load again: a failed check stops the readers, so other files' chunks may be missing
            self.stream = self.loader._stream(self.plan, self.buffer, self.only)
            return self.stream.wait()
