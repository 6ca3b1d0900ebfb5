"""faas-build's list of the file pages a start from a CRIU snapshot touches (snapshots/start_pages.py says why
and how the entry point reads them): the function started from the snapshot, a short and a longer request
served, then the pages of files its processes hold, from /proc/PID/pagemap, and the pages of the files it read
rather than mapped (Triton's: its baked kernels and the libraries it hashes), which are in no page table: those
files are dropped from the page cache before the start, and what of them is cached after it is what it read."""

from __future__ import annotations

import asyncio
import json
import os
import tempfile
import time
from pathlib import Path
from typing import Iterable

from runtime.logs import get_logger
from runtime.weights.residency import cached_pages
from runtime.weights.temps import write_atomically
from snapshots.start_pages import LIST_FILE, FilePages

log = get_logger("snapshots.start_pages")

#: touched pages this close together are read as one range, with the gap: one request rather than two
GAP_BYTES = 128 << 10
PAGE = os.sysconf("SC_PAGE_SIZE")
#: /proc/PID/pagemap: the page is present; it is the file's page (not a private copy written since)
PRESENT, FILE_PAGE = 1 << 63, 1 << 61
#: the requests the start serves: a short prompt and a longer one (a longer prompt runs other kernels)
PROMPT_TOKENS = (32, 256)


def touched_pages(pids: Iterable[int], leave_out: Iterable[str] = ()) -> list[FilePages]:
    """The pages of files mapped by PIDS present in their page tables, by file, in ranges that join gaps up
    to GAP_BYTES: first each file's first page and the pages written since the file was mapped (CRIU checks
    each file's header, and restores the written pages over the file's, at the start of the restore), then
    the rest. Files under a LEAVE_OUT folder are left out (the weights: read by their own prefetch)."""
    leave_out = tuple(os.path.join(os.path.realpath(folder), "") for folder in leave_out)
    early: dict[str, set[int]] = {}  # page indices, by path
    rest: dict[str, set[int]] = {}
    for pid in pids:
        for start, end, offset, path in file_mappings(pid):
            if path.startswith(leave_out):
                continue
            early.setdefault(path, {0})  # the header, which CRIU checks
            rest.setdefault(path, set())
            for i, file_page in present_pages(pid, start, end):
                (rest if file_page else early)[path].add(offset // PAGE + i)
    listed = []
    for path in sorted(early):
        try:
            stat = os.stat(path)
        except OSError:
            continue
        first = _ranges(sorted(early[path]), stat.st_size)
        then = _ranges(sorted(rest[path] - early[path]), stat.st_size)
        if first or then:
            listed.append(FilePages(path, stat.st_size, stat.st_mtime_ns, first, then))
    return listed


def file_mappings(pid: int) -> list[tuple[int, int, int, str]]:
    """(start, end, file offset, path) of PID's mappings of regular files; [] once it has exited."""
    found = []
    try:
        with open(f"/proc/{pid}/maps") as f:
            lines = f.readlines()
    except OSError:
        return []
    for line in lines:
        fields = line.rstrip("\n").split(maxsplit=5)
        if len(fields) < 6 or fields[4] == "0" or not fields[5].startswith("/") or fields[5].endswith(" (deleted)"):
            continue
        start, end = (int(x, 16) for x in fields[0].split("-"))
        found.append((start, end, int(fields[2], 16), fields[5]))
    return found


def present_pages(pid: int, start: int, end: int) -> list[tuple[int, bool]]:
    """(index from START, whether it is still the file's page) of the pages of START..END present in PID's page
    table. A page of a private mapping written since is a copy: the kernel read the file's page to copy it, and
    CRIU's restore of such a page (relocated data, say) reads it again."""
    try:
        with open(f"/proc/{pid}/pagemap", "rb") as f:
            f.seek(start // PAGE * 8)
            entries = memoryview(f.read((end - start) // PAGE * 8)).cast("Q")
    except OSError:
        return []
    return [(i, bool(entry & FILE_PAGE)) for i, entry in enumerate(entries) if entry & PRESENT]


def _ranges(indices: list[int], size: int) -> tuple[tuple[int, int], ...]:
    """Sorted page INDICES as (offset, length) byte ranges within SIZE, joined across gaps up to GAP_BYTES."""
    ranges: list[list[int]] = []
    for index in indices:
        if ranges and index - ranges[-1][1] <= GAP_BYTES // PAGE:
            ranges[-1][1] = index + 1
        else:
            ranges.append([index, index + 1])
    clipped = ((first * PAGE, min(last * PAGE, size)) for first, last in ranges)
    return tuple((start, end - start) for start, end in clipped if end > start)


def descendants(pid: int) -> list[int]:
    """PID and every process below it, as the kernel lists each thread's children (snapshots/checkpoint.py
    finds the frozen runtime the same way)."""
    found, queue = [], [pid]
    while queue:
        found.append(queue.pop())
        for children in Path(f"/proc/{found[-1]}/task").glob("*/children"):
            try:
                queue.extend(int(child) for child in children.read_text().split())
            except OSError:  # the thread or the process has exited
                continue
    return found


def read_folders() -> list[str]:
    """Folders whose files a start reads rather than maps: Triton's cache (a baked kernel's metadata and binary,
    read at its first launch in a process, one small file after another) and Triton's package (the libraries
    its CUDA backend hashes into a kernel's key). From cold disk those reads wait behind the weights' in the
    disk's queue: unlisted, the decode graphs' kernel loads last as long as the weights' stream
    (docs/benchmarks.md). [] without Triton."""
    try:
        import triton
        from triton import knobs
    except Exception:  # noqa: BLE001 - no Triton, nothing of it to read
        return []
    return [knobs.cache.dir, os.path.dirname(triton.__file__)]


def files_under(folders: Iterable[str]) -> list[str]:
    """The regular files under FOLDERS (symbolic links not followed), sorted."""
    found = []
    for folder in folders:
        for root, _, names in os.walk(folder):
            found.extend(path for path in (os.path.join(root, n) for n in names)
                         if os.path.isfile(path) and not os.path.islink(path))
    return sorted(found)


def evict(paths: Iterable[str]) -> None:
    """Drop PATHS' pages from the page cache, written back first (a dirty page stays), so that what of them is
    cached after a start is what the start read."""
    for path in paths:
        try:
            fd = os.open(path, os.O_RDONLY)
        except OSError:
            continue
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        except OSError:
            pass
        finally:
            os.close(fd)


def read_pages(paths: Iterable[str], leave_out: Iterable[str] = ()) -> list[FilePages]:
    """The pages of PATHS in the page cache, found in windows of GAP_BYTES, as ranges by file: what was read of
    them since they were `evict`ed. Paths in LEAVE_OUT are left out (files mapped: the start's are listed by
    touched_pages, and a file mapped anywhere keeps its pages through an eviction). [] where the kernel cannot
    say what is in the page cache."""
    leave_out = set(leave_out)
    window = GAP_BYTES // PAGE
    listed = []
    for path in paths:
        if path in leave_out:
            continue
        try:
            fd = os.open(path, os.O_RDONLY)
        except OSError:
            continue
        try:
            stat = os.fstat(fd)
            indices = []
            for first in range(0, -(-stat.st_size // PAGE), window):
                cached = cached_pages(fd, first * PAGE, window * PAGE)
                if cached is None:
                    return []
                if cached:
                    indices.extend(range(first, first + window))
        finally:
            os.close(fd)
        ranges = _ranges(indices, stat.st_size)
        if ranges:
            listed.append(FilePages(path, stat.st_size, stat.st_mtime_ns, (), ranges))
    return listed


def write_list(directory: Path, files: list[FilePages], kind: str) -> Path:
    """DIRECTORY/LIST_FILE, written whole or not at all."""
    record = {"kind": kind, "recorded_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
              "gap_bytes": GAP_BYTES, "bytes": sum(f.bytes for f in files),
              "files": [{"path": f.path, "size": f.size, "mtime_ns": f.mtime_ns,
                         "early": [list(r) for r in f.early], "ranges": [list(r) for r in f.ranges]} for f in files]}
    target = Path(directory) / LIST_FILE
    write_atomically(target, json.dumps(record).encode())
    return target



def record_start_pages(model_dir: Path, snapshot_dir: Path, kind: str, timeout_s: float = 900.0) -> list[FilePages]:
    """Start the function from SNAPSHOT_DIR's KIND snapshot (MODEL=MODEL_DIR, the rest of its settings from
    this environment, as faas-build bakes with), serve two requests (PROMPT_TOKENS), list the file pages its processes
    then hold (the weights left out: their own prefetch reads them) and those it read of `read_folders()`, and
    write the list beside the snapshot.
    Raises BenchError where the start or the request fails; the snapshot is left as it was."""
    with tempfile.TemporaryDirectory(prefix="start-pages-") as logs:
        files = asyncio.run(_start_and_list(model_dir, snapshot_dir, kind, Path(logs) / f"{kind}.log", timeout_s))
    write_list(snapshot_dir / kind, files, kind)
    read = [f for f in files if not f.early]
    log.info("%s snapshot: a start touched %.1f MiB of %d files (of which it read %.1f MiB of %d rather than "
             "mapped them); listed in %s", kind, sum(f.bytes for f in files) / 2**20, len(files),
             sum(f.bytes for f in read) / 2**20, len(read), LIST_FILE)
    return files


async def _start_and_list(model_dir: Path, snapshot_dir: Path, kind: str, log_path: Path,
                          timeout_s: float) -> list[FilePages]:
    import httpx

    from runtime.bench import BenchError
    from runtime.bench.client import stream_completion
    from runtime.bench.instance import Instance
    from runtime.bench.prompt import PromptMaker

    read = files_under(read_folders())
    evict(read)
    instance = Instance.spawn(kind, {"MODEL": str(model_dir), "SNAPSHOT_DIR": str(snapshot_dir)}, log_path)
    try:
        async with httpx.AsyncClient() as client:
            await instance.wait_ready(client, timeout_s)
            instance.check_restore_path()
            prompts = PromptMaker(str(model_dir))
            for tokens in PROMPT_TOKENS:
                timing = await stream_completion(client, instance.url, prompts.prompt(tokens), 2, timeout_s,
                                                 every_token=True)
                if not timing.ok:
                    raise BenchError(f"a request to the {kind} start failed: {timing.error}")
            touched = touched_pages(descendants(instance.process.pid), leave_out=[str(model_dir)])
            mapped = {f.path for f in touched} | {path for *_, path in file_mappings(os.getpid())}
            return touched + read_pages(read, leave_out=mapped)
    finally:
        await instance.stop()
