"""A chunk checksum the GPU computes over the bytes after they land, so the host reads each byte once.

Hashing on the host costs the loader a second pass over every byte (or, hashed in small windows while they
are in cache, sixteen times as many reads, each a hand-over of the GIL): either way the host's hashing, not
the read, bounded a verified load from the page cache on the H100 machine. The GPU reads 15 GiB of landed
weights in a few milliseconds, so a load from local files into a CUDA buffer is verified there: the layout
records this checksum beside its host hash (manifest `device_sums`), faas-build computes it with `chunk_sum`
below, and the loader with `DeviceCheck`.

The checksum of a chunk: its bytes as little-endian 32-bit words w_i (the last one zero-padded), and

    sum over i of fmix64((i << 32) | w_i)   (mod 2**64)

where fmix64 is MurmurHash3's 64-bit finaliser, a bijection. Changing any one word always changes the sum;
any other damage (words swapped, bytes shifted, a block zeroed) leaves it unchanged with a chance of about
2**-64. Like xxh3 it is a checksum against accidents, not a signature.
"""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    import torch

    from runtime.weights.manifest import Manifest

MASK = (1 << 64) - 1
_M1, _M2 = np.uint64(0xFF51AFD7ED558CCD), np.uint64(0xC4CEB9FE1A85EC53)
_BLOCK_WORDS = 1 << 20  # the numpy reference works in 4 MiB blocks: bounded memory, cache-sized passes


def _fmix64(x: np.ndarray) -> np.ndarray:
    x ^= x >> np.uint64(33)
    x *= _M1
    x ^= x >> np.uint64(33)
    x *= _M2
    x ^= x >> np.uint64(33)
    return x


class ChunkSum:
    """The checksum of one chunk fed in pieces (each but the last a multiple of 4 bytes long)."""

    def __init__(self) -> None:
        self.words = 0
        self.value = 0
        self._tail = b""

    def update(self, data: bytes | memoryview) -> None:
        if self._tail:
            raise ValueError("only the last piece of a chunk may end inside a word")
        a = np.frombuffer(data, dtype=np.uint8)
        full = len(a) // 4
        for first in range(0, full, _BLOCK_WORDS):
            n = min(_BLOCK_WORDS, full - first)
            w = a[4 * first:4 * (first + n)].view("<u4").astype(np.uint64)
            i = np.arange(self.words + first, self.words + first + n, dtype=np.uint64)
            self.value = (self.value + int(_fmix64((i << np.uint64(32)) | w).sum(dtype=np.uint64))) & MASK
        self.words += full
        self._tail = bytes(a[4 * full:])

    def digest(self) -> int:
        if not self._tail:
            return self.value
        word = int.from_bytes(self._tail.ljust(4, b"\0"), "little")
        last = _fmix64(np.array([(self.words << 32) | word], dtype=np.uint64))
        return (self.value + int(last[0])) & MASK

    def hexdigest(self) -> str:
        return f"{self.digest():016x}"


def chunk_sum(data: bytes | memoryview) -> str:
    s = ChunkSum()
    s.update(data)
    return s.hexdigest()


# -- on the device ----------------------------------------------------------------------------------------

PARTS = 64  # programs per chunk; their partial sums are added on the host
BLOCK = 1024  # words per program per step


def device_chunk_sums(buffer: "torch.Tensor", spans: list[tuple[int, int]]) -> "torch.Tensor":
    """Launch the checksums of the chunks at `spans` ((byte offset, length) in the uint8 `buffer`, offsets
    multiples of 4) on the current stream. Returns the [chunks, PARTS] partial sums (int64 bits) to add up
    with `add_partials` once the stream has run."""
    import torch

    table = torch.tensor([s for s, _ in spans] + [n for _, n in spans], dtype=torch.int64)
    if buffer.device.type == "cuda":
        # from pinned memory, so the copy is queued: one from pageable memory would wait for the stream,
        # which waits for the file's weight copies, and stall the reader thread that launched it
        table = table.pin_memory().to(buffer.device, non_blocking=True)
    out = torch.empty((len(spans), PARTS), dtype=torch.int64, device=buffer.device)
    launch_chunk_sums(buffer, table[:len(spans)], table[len(spans):], out)
    return out


def launch_chunk_sums(buffer: "torch.Tensor", starts: "torch.Tensor", lengths: "torch.Tensor",
                      out: "torch.Tensor") -> None:
    """The kernel over the chunks at `starts`/`lengths` (int64 tensors on the buffer's device), into `out`
    ([chunks, PARTS]), on the current stream."""
    from runtime.weights.checksum_kernel import chunk_sums  # Triton: imported only where weights land on a GPU

    chunk_sums[(len(starts), PARTS)](buffer, starts, lengths, out, PARTS=PARTS, BLOCK=BLOCK)


def add_partials(partials: np.ndarray) -> list[str]:
    """Hex checksums from the kernel's [chunks, PARTS] partial sums."""
    sums = partials.view(np.uint64).sum(axis=1, dtype=np.uint64)
    return [f"{int(s):016x}" for s in sums]


#: chunks are checked in groups of consecutive chunks of one file, at most this many bytes: the group that
#: lands last is checked after the load's last copy, so it is kept small
GROUP_BYTES = 256 << 20


class DeviceCheck:
    """Verifies a load into a CUDA buffer group by group: when the last chunk of a group (GROUP_BYTES of one
    file) has been copied, its checksums are launched on a stream of their own (after the copies' events),
    overlapping the rest of the load; `mismatches()` at the end compares them with the manifest.

    On the H100 machine, checking whole files put ~2.5 ms after the last copy of a 75 ms Qwen2-1.5B load
    (its last file's 0.9 GiB, the launch, and one result copy per file), and the launch of the first file
    held a reader for ~2 ms. So the chunk table goes to the GPU once, before the load, a launch is one
    kernel over a group, and the results come back in one copy."""

    def __init__(self, manifest: "Manifest", buffer: "torch.Tensor", group_bytes: int = GROUP_BYTES,
                 only: frozenset[int] | None = None) -> None:
        """ONLY: the chunks of the load (indices over the files' chunks in order) when it is a subset."""
        import torch

        self.manifest = manifest
        self.buffer = buffer
        spans: list[tuple[int, int]] = []
        self._where: list[tuple[int, int]] = []  # (file, chunk in file) of each chunk of the load
        self._index: dict[int, int] = {}  # a chunk's index over all files -> its index among the load's
        expected: list[str] = []
        groups: list[list[int]] = []
        whole = -1
        for f, entry in enumerate(manifest.files):
            size = group_bytes
            for j, (off, n) in enumerate(entry.chunks()):
                whole += 1
                if only is not None and whole not in only:
                    size = group_bytes  # a gap: the next chunk of the load starts a group
                    continue
                self._index[whole] = len(spans)
                expected.append(entry.device_sums[j])
                if not groups or j == 0 or size + n > group_bytes:
                    groups.append([])
                    size = 0
                groups[-1].append(len(spans))
                size += n
                spans.append((entry.buffer_offset + off, n))
                self._where.append((f, j))
        self._expected = expected
        self._group_of = [g for g, members in enumerate(groups) for _ in members]
        self._range = [(members[0], members[-1] + 1) for members in groups]
        self._left = [len(members) for members in groups]
        self._events: list[list] = [[] for _ in groups]
        self._stream = torch.cuda.Stream(buffer.device)
        # from pinned memory on the check stream: queued, and before every kernel launched on it
        self._table = torch.tensor([s for s, _ in spans] + [n for _, n in spans], dtype=torch.int64).pin_memory()
        with torch.cuda.stream(self._stream):
            table = self._table.to(buffer.device, non_blocking=True)
            self._partials = torch.empty((len(spans), PARTS), dtype=torch.int64, device=buffer.device)
        self._starts, self._lengths = table[:len(spans)], table[len(spans):]
        self._lock = threading.Lock()  # one launcher at a time: Triton's first launch is not thread-safe

    def chunk_landed(self, chunk: int, events: list) -> None:
        """Chunk `chunk` (files' chunks in order) is copied once `events` complete; after the last chunk of its
        group the group's checksums are launched."""
        g = self._group_of[self._index[chunk]]
        with self._lock:
            self._events[g] += [e for e in events if not any(e is seen for seen in self._events[g])]
            self._left[g] -= 1
            if self._left[g]:
                return
            import torch

            for event in self._events[g]:
                self._stream.wait_event(event)
            a, b = self._range[g]
            with torch.cuda.stream(self._stream):
                launch_chunk_sums(self.buffer, self._starts[a:b], self._lengths[a:b], self._partials[a:b])

    def mismatches(self) -> list[tuple[int, int]]:
        """(file, chunk) of every chunk whose checksum differs from the manifest's."""
        self._stream.synchronize()
        unchecked = sorted({self._where[a][0] for g, (a, _) in enumerate(self._range) if self._left[g]})
        if unchecked:
            raise RuntimeError(f"files {unchecked} were never checked")
        got = add_partials(self._partials.cpu().numpy())
        return [self._where[i] for i, (a, b) in enumerate(zip(got, self._expected)) if a != b]
