"""A chunk checksum the GPU computes over the bytes after they land, so the host reads each byte once.

Hashing on the host costs the loader a second pass over every byte (or, hashed in small windows while they
are in cache, sixteen times as many reads, each a hand-over of the GIL). On the H100 machine either kept a
verified page-cache load near 25 GiB/s against a 41 GiB/s read limit (docs/benchmarks.md, "Weight
loading"). The GPU reads 15 GiB of landed weights in a few milliseconds, so a load from local files into a
CUDA buffer is verified there: the layout records this checksum beside its host hash (manifest
`device_sums`), faas-build computes it with `chunk_sum` below, and the loader with `DeviceCheck`.

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
    starts, lengths = table[:len(spans)], table[len(spans):]
    out = torch.empty((len(spans), PARTS), dtype=torch.int64, device=buffer.device)
    from runtime.weights.checksum_kernel import chunk_sums  # Triton: imported only where weights land on a GPU

    chunk_sums[(len(spans), PARTS)](buffer, starts, lengths, out, PARTS=PARTS, BLOCK=BLOCK)
    return out


def add_partials(partials: np.ndarray) -> list[str]:
    """Hex checksums from the kernel's [chunks, PARTS] partial sums."""
    sums = partials.view(np.uint64).sum(axis=1, dtype=np.uint64)
    return [f"{int(s):016x}" for s in sums]


class DeviceCheck:
    """Verifies a load into a CUDA buffer file by file: when the last chunk of a file has been copied, its
    checksums are launched on a stream of their own (after the copies' events), overlapping the rest of
    the load; `mismatches()` at the end of the load compares them with the manifest."""

    def __init__(self, manifest: "Manifest", buffer: "torch.Tensor") -> None:
        import torch

        self.manifest = manifest
        self.buffer = buffer
        self._left = [len(f.chunks()) for f in manifest.files]
        self._events: list[list] = [[] for _ in manifest.files]
        self._stream = torch.cuda.Stream(buffer.device)
        self._partials: dict[int, torch.Tensor] = {}
        self._lock = threading.Lock()  # one launcher at a time: Triton's first launch is not thread-safe

    def chunk_landed(self, file: int, events: list) -> None:
        """A chunk of `file` is copied once `events` complete; after the file's last chunk its checksums
        are launched."""
        with self._lock:
            self._events[file] += events
            self._left[file] -= 1
            if self._left[file]:
                return
            import torch

            for event in self._events[file]:
                self._stream.wait_event(event)
            entry = self.manifest.files[file]
            with torch.cuda.stream(self._stream):
                spans = [(entry.buffer_offset + off, n) for off, n in entry.chunks()]
                self._partials[file] = device_chunk_sums(self.buffer, spans)

    def mismatches(self) -> list[tuple[int, int]]:
        """(file, chunk) of every chunk whose checksum differs from the manifest's."""
        self._stream.synchronize()
        bad = []
        for file, partials in sorted(self._partials.items()):
            got = add_partials(partials.cpu().numpy())
            bad += [(file, j) for j, (a, b) in enumerate(zip(got, self.manifest.files[file].device_sums)) if a != b]
        missing = [f for f in range(len(self.manifest.files)) if f not in self._partials]
        if missing:
            raise RuntimeError(f"files {missing} were never checked")
        return bad
