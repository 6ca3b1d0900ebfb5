"""The file pages a start touches (snapshots/start_pages.py, snapshots/start_pages_record.py): what a running
process touched of a file it maps is listed (the pages it wrote, and the file's header, first), and a list is
read back into a dropped page cache exactly, no page around it; a file changed since, a warm page cache or a
missing list reads nothing and says why."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from runtime.weights.residency import cached_bytes
from snapshots import start_pages
from snapshots.start_pages import LIST_FILE, FilePages, read_list
from snapshots.start_pages_record import (GAP_BYTES, PAGE, evict, files_under, read_folders, read_pages, touched_pages,
                                          write_list)
from tests.test_weights_prefetch import STILL_CACHED
from tests.test_weights_prefetch import drop_from_page_cache as drop_files

MiB = 1 << 20

#: maps FILE privately, reads a byte at each offset given, writes one at the last, then waits for stdin
TOUCHER = """
import mmap, sys
path, *offsets = sys.argv[1:]
with open(path, "rb") as f:
    m = mmap.mmap(f.fileno(), 0, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ | mmap.PROT_WRITE)
total = sum(m[int(o)] for o in offsets)
m[int(offsets[-1])] = (m[int(offsets[-1])] + 1) % 256
print("touched", total % 2, flush=True)
sys.stdin.read()
"""


def data_file(path: Path, size: int) -> Path:
    path.write_bytes(os.urandom(size))
    return path


def drop_from_page_cache(path: Path) -> None:
    drop_files([str(path)])  # skips where the kernel cannot say or keeps most of the file
    if cached_bytes(path):
        pytest.skip("this machine's page cache keeps part of the file after POSIX_FADV_DONTNEED")


def covers(ranges, offset: int) -> bool:
    return any(start <= offset < start + length for start, length in ranges)


def test_what_a_process_touched_of_a_mapped_file_is_listed(tmp_path):
    path = data_file(tmp_path / "lib.so", 16 * MiB)
    offsets = [1 * MiB + 100, 6 * MiB, 11 * MiB + 5 * PAGE]
    child = subprocess.Popen([sys.executable, "-c", TOUCHER, str(path), *map(str, offsets)], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline().startswith("touched")
        listed = {f.path: f for f in touched_pages([child.pid])}
        left_out = {f.path for f in touched_pages([child.pid], leave_out=[str(tmp_path)])}
    finally:
        child.stdin.close()
        child.wait(10)
    pages = listed[str(path)]
    assert pages.size == 16 * MiB and pages.mtime_ns == path.stat().st_mtime_ns
    assert covers(pages.early, 0) and covers(pages.early, offsets[-1])  # the header; the page written over
    assert all(covers(pages.early + pages.ranges, offset) for offset in offsets)
    # the pages touched and what the kernel mapped with them (fault-around, a large folio: up to 2 MiB), not the file
    assert pages.bytes <= len(offsets) * (2 * MiB + GAP_BYTES) + PAGE
    assert not covers(pages.early + pages.ranges, 3 * MiB) and not covers(pages.early + pages.ranges, 14 * MiB)
    assert str(path) not in left_out
    assert any(p.endswith(".so") or "python" in p for p in listed if p != str(path))  # the interpreter's own


def test_what_a_start_read_of_a_folder_rather_than_mapped_is_listed(tmp_path):
    """Triton's files are read, not mapped: after `evict`, what is cached of a folder's files is what was read
    since, in GAP_BYTES windows; a file not read is not listed, nor one left out (mapped); the list reads it
    back."""
    folder = tmp_path / "cache" / "kernel"
    folder.mkdir(parents=True)
    read, unread, mapped = (data_file(folder / name, 2 * MiB) for name in ("k.cubin", "k.ptx", "lib.so"))
    paths = files_under([str(tmp_path / "cache")])
    assert paths == sorted(map(str, (read, unread, mapped)))
    evict(paths)
    drop_from_page_cache(read)  # skips where this machine's page cache keeps the files
    with open(read, "rb") as f:
        f.seek(1 * MiB)
        f.read(10 * PAGE)
    with open(mapped, "rb") as f:
        f.read()
    listed = {f.path: f for f in read_pages(paths, leave_out=[str(mapped)])}
    assert set(listed) == {str(read)}
    pages = listed[str(read)]
    assert pages.early == () and covers(pages.ranges, 1 * MiB) and covers(pages.ranges, 1 * MiB + 9 * PAGE)
    assert not covers(pages.ranges, 0) and pages.bytes <= 4 * GAP_BYTES  # the read, the kernel's read-ahead

    snapshots = tmp_path / "snapshots"
    write_snapshot_list(snapshots, [pages])
    evict(paths)
    reading = start_pages.start(str(snapshots), "process")
    assert reading is not None and reading.join(30) and reading.error is None
    assert STILL_CACHED * pages.bytes <= cached_bytes(read) <= pages.bytes and cached_bytes(unread) == 0


def test_the_folders_read_are_the_triton_cache_the_function_is_baked_with_and_tritons_package(tmp_path,
                                                                                               monkeypatch):
    triton = pytest.importorskip("triton")
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "kernels"))
    folders = read_folders()
    assert str(tmp_path / "kernels") in folders and str(Path(triton.__file__).parent) in folders


def write_snapshot_list(snapshot_dir: Path, files: list[FilePages]) -> None:
    (snapshot_dir / "process").mkdir(parents=True, exist_ok=True)
    write_list(snapshot_dir / "process", files, "process")


def test_a_list_is_read_into_a_dropped_page_cache_exactly(tmp_path):
    path = data_file(tmp_path / "lib.so", 16 * MiB)
    stat = path.stat()
    early, ranges = ((0, PAGE),), ((4 * MiB, 64 * 1024), (12 * MiB, 9 * MiB // 8))
    snapshots = tmp_path / "snapshots"
    write_snapshot_list(snapshots, [FilePages(str(path), stat.st_size, stat.st_mtime_ns, early, ranges)])
    assert read_list(snapshots / "process" / LIST_FILE)[0].ranges == ranges
    drop_from_page_cache(path)

    reading = start_pages.start(str(snapshots), "process")
    assert reading is not None and start_pages.skipped is None
    assert reading.join(30) and reading.error is None
    listed = PAGE + 64 * 1024 + 9 * MiB // 8
    assert reading.bytes == listed
    assert STILL_CACHED * listed <= cached_bytes(path) <= listed  # no read-ahead around the pieces

    assert start_pages.start(str(snapshots), "process") is None
    assert start_pages.skipped == "the listed pages are in the page cache"


def test_what_is_not_read_and_why(tmp_path):
    path = data_file(tmp_path / "lib.so", 4 * MiB)
    stat = path.stat()
    snapshots = tmp_path / "snapshots"
    assert start_pages.start(str(snapshots), "process") is None
    assert start_pages.skipped == f"no {LIST_FILE} beside the process snapshot"

    write_snapshot_list(snapshots, [FilePages(str(path), stat.st_size, stat.st_mtime_ns - 10**9, ((0, PAGE),), ())])
    drop_from_page_cache(path)
    assert start_pages.start(str(snapshots), "process") is None
    assert start_pages.skipped == "none of the listed files is as it was baked"
    assert cached_bytes(path) == 0

    (snapshots / "process" / LIST_FILE).write_text('{"files": [{"path": "x"}]}')
    assert start_pages.start(str(snapshots), "process") is None
    assert start_pages.skipped.startswith("ValueError") and "not a list of start pages" in start_pages.skipped


def test_the_read_probe_reads_a_list_both_ways_exactly_or_says_why_not(tmp_path):
    """scripts/probe_start_pages_read.py: from a dropped page cache, one read per thread and all queued at once
    each bring in the listed pages and no other (the last way's leave exactly those cached); a missing list is
    one line and exit 2."""
    import json

    path = data_file(tmp_path / "lib.so", 8 * MiB)
    drop_from_page_cache(path)  # skips where this machine's page cache keeps the file
    stat = path.stat()
    early, ranges = ((0, PAGE),), ((2 * MiB, 64 * PAGE), (6 * MiB, 16 * PAGE))
    listed = write_list(tmp_path, [FilePages(str(path), stat.st_size, stat.st_mtime_ns, early, ranges)], "process")
    repo, out = Path(__file__).resolve().parents[2], tmp_path / "probe.json"
    done = subprocess.run([sys.executable, "scripts/probe_start_pages_read.py", str(listed), "--rounds", "1",
                           "--out", str(out)], cwd=repo, capture_output=True, text=True, timeout=120)
    if done.returncode == 2 and "cannot drop the page cache" in done.stderr:
        pytest.skip(done.stderr.strip())
    assert done.returncode == 0, done.stderr
    report = json.loads(out.read_text())
    assert report["bytes"] == 81 * PAGE and report["pieces"] == 3
    assert set(report["median_s"]) == {"one per thread", "queued"} and min(report["median_s"].values()) > 0
    assert STILL_CACHED * 81 * PAGE <= cached_bytes(path) <= 81 * PAGE
    bad = subprocess.run([sys.executable, "scripts/probe_start_pages_read.py", str(tmp_path / "nowhere.json")],
                         cwd=repo, capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and len(bad.stderr.strip().splitlines()) == 1 and "nowhere.json" in bad.stderr


def test_the_list_by_file_names_each_file_largest_first_or_says_why_not(tmp_path):
    """scripts/start_pages_by_file.py: each listed file with its listed and early MiB, the largest first, and the
    total; a file that is no list is one line and exit 2."""
    big, small = data_file(tmp_path / "libbig.so", 8 * MiB), data_file(tmp_path / "libsmall.so", 1 * MiB)
    listed = write_list(tmp_path, [
        FilePages(str(small), small.stat().st_size, small.stat().st_mtime_ns, ((0, PAGE),), ()),
        FilePages(str(big), big.stat().st_size, big.stat().st_mtime_ns, ((0, PAGE),), ((1 * MiB, 2 * MiB),))],
        "process")
    repo = Path(__file__).resolve().parents[2]
    done = subprocess.run([sys.executable, "scripts/start_pages_by_file.py", str(listed)], cwd=repo,
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    rows = [line for line in done.stdout.splitlines() if line.startswith("| lib")]
    assert [row.split("|")[1].strip() for row in rows] == ["libbig.so", "libsmall.so"]
    assert rows[0].split("|")[2].strip() == f"{(2 * MiB + PAGE) / MiB:.1f}"
    assert done.stdout.strip().endswith("of 2 files")
    bad = subprocess.run([sys.executable, "scripts/start_pages_by_file.py", str(big)], cwd=repo,
                         capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and len(bad.stderr.strip().splitlines()) == 1
