"""The rows of the input embedding table a process restore left for after ready (EMBEDDING_LAST): read by this
process from the layout, each block checked against its digest before it is copied into the table.

The weights' helper streams every chunk but the table's whole ones (runtime/weights/embedding_blocks.py says
why), and the engine serves once those have arrived. From then:
- a thread reads the blocks still missing, in order, BATCH_BLOCKS at a time (the entry point's prefetch reads
  the same bytes into the page cache, last of the weights), checks each and copies the batch in;
- before each step, `ensure` reads the missing blocks of the step's tokens, all at once on a pool of threads
  (from a disk busy with the prefetch, one at a time would each wait behind its queue), checks and copies them;
- the engine launches no step before the last one's tokens are read until the table is complete: a step's
  tokens must be known for their rows to be read.
A block that fails its check is never copied: a step that needs one of its rows fails the requests whose tokens
they are, with an error naming the block, and the table stays incomplete.
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import nullcontext
from typing import Iterable

import torch

from runtime import timeline as stages
from runtime.logs import get_logger
from runtime.timeline import Timeline
from runtime.weights.embedding_blocks import EmbeddingBlocks
from runtime.weights.errors import WeightsError
from runtime.weights.loader import layout_chunks
from runtime.weights.manifest import Manifest
from runtime.weights.sources import LocalFile

log = get_logger("engine.embedding_fill")

#: blocks the filling thread reads, checks and copies at once (512 blocks: 32 MiB of Llama-3-8B's table)
BATCH_BLOCKS = 512
#: threads reading a step's missing blocks at once (a 161-token prompt has about 100 blocks to read)
READERS = 32


class BadRows(WeightsError):
    """Rows a step needs whose block failed its check; `rows` are those token ids."""

    def __init__(self, message: str, rows: frozenset[int]) -> None:
        super().__init__(message)
        self.rows = rows


class EmbeddingFill:
    """The table's missing blocks: filled in the background once `start()`ed, and on demand by `ensure`."""

    def __init__(self, blocks: EmbeddingBlocks, manifest: Manifest, deferred: frozenset[int], buffer: torch.Tensor,
                 timeline: Timeline) -> None:
        """BLOCKS: the layout's block digests (`EmbeddingBlocks.read`); DEFERRED: the layout chunks
        (runtime/weights/loader.py's `layout_chunks` order) not in BUFFER, the engine's flat weight buffer."""
        self.blocks = b = blocks
        chunks = [c for i, c in enumerate(layout_chunks(manifest)) if i in deferred]
        lo = min(c.buffer_offset for c in chunks) - b.buffer_offset  # the missing bytes, in the table
        hi = max(c.buffer_offset + c.length for c in chunks) - b.buffer_offset
        self._missing = bytearray(1 if off < hi and off + n > lo else 0
                                  for off, n in map(b.block_bytes, range(b.blocks)))
        self.deferred_bytes = hi - lo
        self._table = buffer[b.buffer_offset:b.buffer_offset + b.rows * b.row_bytes]
        self._timeline = timeline
        self._file: LocalFile | None = LocalFile(b.file)
        self._pool = ThreadPoolExecutor(READERS, thread_name_prefix="embedding-rows")
        self._thread = threading.Thread(target=self._fill, name="embedding-fill", daemon=True)
        self.failed: dict[int, str] = {}  # block -> why
        self.on_demand_blocks = 0
        self.on_demand_s = 0.0  # steps' time in `ensure` reading blocks
        self.complete = threading.Event()
        self._served = threading.Event()
        self._stop = threading.Event()
        self.started = time.time()

    def start(self, after_first_step_s: float = 0.0) -> None:
        """Fill the rest in the background: once a step has run (`stepped()`), or AFTER_FIRST_STEP_S from now
        without one, so that the request that woke the function is not slowed by it."""
        self.started = time.time()
        self._wait_s = after_first_step_s
        self._thread.start()

    def stepped(self) -> None:
        self._served.set()

    def stop(self) -> None:
        """Stop the filling and close the file (the engine shuts down): a thread copying into the device's
        memory as the process exits would abort it."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=10)
        self.close()

    def close(self) -> None:
        """Done: by the caller of `ensure`, once it has seen `complete` (no step reads a block any more)."""
        self._pool.shutdown(wait=False)
        if self._file is not None:
            self._file.close(ok=True)
            self._file = None

    @property
    def missing_blocks(self) -> int:
        return sum(self._missing)

    # -- a step's rows ---------------------------------------------------------------------------------

    def ensure(self, token_ids: Iterable[int]) -> None:
        """The rows of TOKEN_IDS in the table before this returns. Raises BadRows (the rows whose block
        failed its check) after copying every other one."""
        if self.complete.is_set():
            return
        token_ids = list(token_ids)
        wanted = {t // self.blocks.rows_per_block for t in token_ids}
        blocks = sorted(k for k in wanted if self._missing[k])
        if not blocks:
            return
        started = time.time()
        bad = {}
        for block, data in zip(blocks, self._pool.map(self._read_block, blocks)):
            if self._missing[block] and not self._copy_checked(block, data):
                bad[block] = self.failed[block]
        self.on_demand_blocks += len(blocks)
        self.on_demand_s += time.time() - started
        if bad:
            per = self.blocks.rows_per_block
            rows = frozenset(t for t in token_ids if t // per in bad)
            block = min(bad)
            raise BadRows(f"{self.blocks.file}: embedding table block {block} (rows {block * per}-"
                          f"{min((block + 1) * per, self.blocks.rows) - 1}) fails its {self.blocks.hash} check: the "
                          "layout is corrupt or was changed after it was built", rows)

    def _read_block(self, block: int) -> bytearray:
        offset, n = self.blocks.block_bytes(block)
        return self._read(offset, n)

    def _read(self, offset: int, n: int) -> bytearray:
        data = bytearray(n)
        self._file.read_into(self.blocks.file_offset + offset, memoryview(data))
        return data

    def _copy_checked(self, block: int, data) -> bool:
        """Copy BLOCK's DATA into the table if it passes its check (else note why not); whether it did."""
        if not self.blocks.check(block, data):
            self.failed[block] = "fails its check"
            return False
        offset, n = self.blocks.block_bytes(block)
        self._table[offset:offset + n].copy_(torch.frombuffer(data, dtype=torch.uint8))
        self._missing[block] = 0
        return True

    # -- the rest, in the background ---------------------------------------------------------------------

    def _fill(self) -> None:
        self._served.wait(self._wait_s)
        try:
            stream = torch.cuda.Stream(self._table.device) if self._table.is_cuda else None
            with torch.cuda.stream(stream) if stream is not None else nullcontext():
                for first in range(0, self.blocks.blocks, BATCH_BLOCKS):
                    if self._stop.is_set():
                        return
                    batch = [k for k in range(first, min(first + BATCH_BLOCKS, self.blocks.blocks))
                             if self._missing[k]]
                    if batch:
                        self._fill_batch(batch)
        except Exception as exc:  # noqa: BLE001 - the steps read what they need; the table stays incomplete
            log.error("embedding table: reading its rest failed (%s: %s); steps read the rows they need",
                      type(exc).__name__, exc)
            return
        finally:
            self._finish()

    def _fill_batch(self, batch: list[int]) -> None:
        start = self.blocks.block_bytes(batch[0])[0]
        end = sum(self.blocks.block_bytes(batch[-1]))
        data = memoryview(self._read(start, end - start))
        good = []
        for block in batch:
            offset, n = self.blocks.block_bytes(block)
            if self.blocks.check(block, data[offset - start:offset - start + n]):
                good.append(block)
            else:
                self.failed[block] = "fails its check"
        if len(good) == len(batch) and batch[-1] - batch[0] == len(batch) - 1:
            self._table[start:end].copy_(torch.frombuffer(data, dtype=torch.uint8))
        else:
            for block in good:
                offset, n = self.blocks.block_bytes(block)
                self._table[offset:offset + n].copy_(torch.frombuffer(data[offset - start:offset - start + n],
                                                                      dtype=torch.uint8))
        for block in good:
            self._missing[block] = 0

    def _finish(self) -> None:
        if self._stop.is_set():
            return
        ended = time.time()
        detail = {"bytes": self.deferred_bytes, "blocks_on_demand": self.on_demand_blocks,
                  "on_demand_s": round(self.on_demand_s, 4)}
        if self.failed:
            log.error("embedding table: %d blocks fail their check (the first: %d): steps that need their rows "
                      "fail; the layout is corrupt or was changed after it was built", len(self.failed),
                      min(self.failed))
            detail["failed_blocks"] = len(self.failed)
        elif not self.missing_blocks:
            self.complete.set()
            log.info("embedding table: complete %.3f s after ready (%d blocks read on demand in %.3f s)",
                     ended - self.started, self.on_demand_blocks, self.on_demand_s)
        self._timeline.record(stages.EMBEDDING_AFTER_READY, self.started, ended, **detail)
