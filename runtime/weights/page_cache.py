"""Weights that are already in the page cache go to the GPU straight from it: the layout file is mapped,
the mapping registered with CUDA (page-locked in place), and copied by DMA with no pinned bounce buffer.

Reading into a pinned ring costs a memory-to-memory copy of every byte on the host before the DMA reads it
again; registering the page cache's own pages skips that copy (the H100 machine registered a mapped 8 GiB
file at 35 GiB/s and copied from it at 51 GiB/s, docs/benchmarks.md). Registering pulls in pages that are
not resident, one at a time and synchronously, so only files wholly in the page cache take this way
(`resident`); the rest are read as before. The readers still hash every chunk, from the mapping.

One registrar thread maps and registers the files in buffer order and queues each chunk's copy as soon as
its file is registered; a file is unregistered and unmapped once its copies have completed.
"""

from __future__ import annotations

import ctypes
import mmap
import os
import threading

import torch

from runtime.logs import get_logger

log = get_logger("weights.page_cache")

PAGE = mmap.PAGESIZE
_PROT_READ, _MAP_SHARED = 1, 1
_HOST_REGISTER_READ_ONLY = 8  # cudaHostRegisterReadOnly: the GPU only reads it; allowed on read-only maps

_libc = ctypes.CDLL(None, use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
_libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
_libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]


class Mapping:
    """A read-only shared mapping of a whole file."""

    def __init__(self, fd: int, size: int) -> None:
        self.size = size
        address = _libc.mmap(None, max(size, 1), _PROT_READ, _MAP_SHARED, fd, 0)
        if address in (None, ctypes.c_void_p(-1).value):
            raise OSError(ctypes.get_errno(), "mmap")
        self.address: int = address

    def view(self, offset: int, length: int) -> memoryview:
        return memoryview((ctypes.c_char * length).from_address(self.address + offset)).cast("B")

    def host_tensor(self, offset: int, length: int) -> torch.Tensor:
        return torch.frombuffer((ctypes.c_char * length).from_address(self.address + offset), dtype=torch.uint8)

    def resident(self) -> bool:
        """Every page of the file in the page cache (mincore)."""
        pages = -(-self.size // PAGE)
        vector = (ctypes.c_ubyte * pages)()
        if _libc.mincore(self.address, self.size, vector) != 0:
            return False
        return all(b & 1 for b in bytes(vector))

    def close(self) -> None:
        _libc.munmap(self.address, max(self.size, 1))


class PageCacheDMA:
    """Copies of the chunks of page-cache-resident files, queued by a registrar thread. `chunks[i]` is
    (file, offset in file, length, offset in the buffer) as the loader numbers them."""

    def __init__(self, mappings: dict[int, Mapping], chunks: list[tuple[int, int, int, int]],
                 buffer: torch.Tensor, ready_to_write: torch.cuda.Event) -> None:
        self.mappings = mappings
        self.chunks = chunks
        self.buffer = buffer
        self._ready_to_write = ready_to_write
        self._queued: dict[int, torch.cuda.Event | None] = {}  # chunk -> its copy's event; None: read it instead
        self._cond = threading.Condition()
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._register_and_copy, name="weights-dma", daemon=True)
        self._thread.start()

    @classmethod
    def for_resident(cls, fds: dict[int, tuple[int, int]], chunks: list[tuple[int, int, int, int]],
                     buffer: torch.Tensor, ready_to_write: torch.cuda.Event) -> "PageCacheDMA | None":
        """`fds`: file index -> (descriptor, size) of the local files. None if none is wholly resident."""
        mappings = {}
        for index, (fd, size) in fds.items():
            mapping = Mapping(fd, size)
            if mapping.resident():
                mappings[index] = mapping
            else:
                mapping.close()
        if not mappings:
            return None
        return cls(mappings, chunks, buffer, ready_to_write)

    def handles(self, file: int) -> bool:
        return file in self.mappings

    def view(self, file: int, offset: int, length: int) -> memoryview:
        return self.mappings[file].view(offset, length)

    def copy_event(self, chunk: int) -> torch.cuda.Event | None:
        """Block until chunk's copy is queued; its event, or None if the chunk must be read the usual way
        (its file could not be registered)."""
        with self._cond:
            while chunk not in self._queued:
                self._cond.wait()
            return self._queued[chunk]

    def join(self) -> None:
        self._thread.join()

    def _register_and_copy(self) -> None:
        try:
            self._queue_copies()
        except BaseException as exc:  # noqa: BLE001 - the readers read what was not queued
            log.warning("page cache DMA stopped (%s: %s); the rest is read", type(exc).__name__, exc)
            self.error = exc
        finally:  # whatever was not queued is read the usual way
            self._publish({i: None for i, c in enumerate(self.chunks) if c[0] in self.mappings
                           and i not in self._queued})

    def _queue_copies(self) -> None:
        torch.cuda.set_device(self.buffer.device)
        stream = torch.cuda.Stream(self.buffer.device)
        stream.wait_event(self._ready_to_write)
        cudart = torch.cuda.cudart()
        registered: list[tuple[int, list[torch.cuda.Event]]] = []
        by_file: dict[int, list[int]] = {}
        for i, (file, *_rest) in enumerate(self.chunks):
            if file in self.mappings:
                by_file.setdefault(file, []).append(i)
        for file in sorted(by_file, key=lambda f: self.chunks[by_file[f][0]][3]):
            mapping = self.mappings[file]
            status = cudart.cudaHostRegister(mapping.address, -(-mapping.size // PAGE) * PAGE,
                                             _HOST_REGISTER_READ_ONLY)
            if int(status) != 0:
                log.warning("page cache DMA: cannot register file %d (cudaError %d); reading it instead",
                            file, int(status))
                self._publish({i: None for i in by_file[file]})
                continue
            events = []
            with torch.cuda.stream(stream):
                for i in by_file[file]:
                    _, offset, length, dst = self.chunks[i]
                    self.buffer[dst:dst + length].copy_(mapping.host_tensor(offset, length), non_blocking=True)
                    event = torch.cuda.Event()
                    event.record(stream)
                    events.append(event)
                    self._publish({i: event})
            registered.append((file, events))
            registered = self._release_copied(cudart, registered, wait=False)
        self._release_copied(cudart, registered, wait=True)

    def _publish(self, queued: dict[int, torch.cuda.Event | None]) -> None:
        with self._cond:
            self._queued.update(queued)
            self._cond.notify_all()

    def _release_copied(self, cudart, registered: list, wait: bool) -> list:
        """Unregister and unmap the files whose copies are done (all of them, waiting, if `wait`)."""
        left = []
        for file, events in registered:
            if wait:
                events[-1].synchronize()
            elif not events[-1].query():
                left.append((file, events))
                continue
            cudart.cudaHostUnregister(self.mappings[file].address)
            # the readers may still be hashing from the mapping: it is unmapped by close()
        return left

    def close(self) -> None:
        self._thread.join()
        for mapping in self.mappings.values():
            mapping.close()
