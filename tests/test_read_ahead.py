"""The threaded page-cache reader the entry point starts (runtime/read_ahead.py): a read-ahead given another
to come after (the weights after the start pages) reads nothing until that one has ended, then reads all of it;
a piece it cannot read ends that share with the reason, not the process. And the probe of the read-ahead beside
a thread running Python."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from runtime.read_ahead import ReadAhead
from runtime.weights import prefetch
from runtime.weights.layout import write_layout
from runtime.weights.residency import cached_bytes, cached_fraction
from tests.test_weights_prefetch import STILL_CACHED, drop_from_page_cache

MiB = 1 << 20


def test_a_read_ahead_after_another_waits_for_its_end(tmp_path):
    blocked = tmp_path / "first"
    os.mkfifo(blocked)  # opening it for reading blocks until a writer opens it: the first read-ahead hangs there
    weights = tmp_path / "weights.bin"
    weights.write_bytes(os.urandom(4 * MiB))
    drop_from_page_cache([str(weights)])

    first = ReadAhead("start pages", [(str(blocked), 0, 4096)], 1)
    second = ReadAhead("weights prefetch", [(str(weights), 0, 4 * MiB)], 2, after=first)
    time.sleep(0.5)
    assert not first.done.is_set() and not second.done.is_set()
    assert cached_bytes(weights) == 0  # nothing read while the first one has not ended

    os.close(os.open(blocked, os.O_WRONLY))  # the first one's open returns; a pipe cannot be read at an offset
    assert first.join(10) and first.error is not None
    assert second.join(10) and second.error is None
    assert STILL_CACHED * 4 * MiB <= cached_bytes(weights) <= 4 * MiB
    assert second.bytes == 4 * MiB and second.ended >= first.ended


def test_the_last_pieces_wait_until_every_piece_before_them_is_read(tmp_path):
    """The embedding table's pieces, last of a restore's prefetch: none is read while a piece before them is
    still in flight, whichever thread is free; a piece before them that fails lets them go."""
    blocked = tmp_path / "slow"
    os.mkfifo(blocked)  # its open blocks until a writer opens it: a piece in flight for as long as the test says
    other, table = tmp_path / "other.bin", tmp_path / "table.bin"
    for path in (other, table):
        path.write_bytes(os.urandom(4 * MiB))
    drop_from_page_cache([str(other), str(table)])

    reading = ReadAhead("weights prefetch", [(str(blocked), 0, 4096), (str(other), 0, 4 * MiB),
                                             (str(table), 0, 4 * MiB)], 2, last=1)
    time.sleep(0.5)
    assert cached_bytes(other) >= STILL_CACHED * 4 * MiB  # the free thread read what came before the table
    assert cached_bytes(table) == 0 and not reading.done.is_set()

    os.close(os.open(blocked, os.O_WRONLY))  # the slow piece's open returns; a pipe cannot be read at an offset
    assert reading.join(30)
    assert cached_bytes(table) >= STILL_CACHED * 4 * MiB and reading.error is not None


def test_the_last_pieces_are_read_by_last_readers_threads_and_the_others_end(tmp_path):
    """The embedding table's pieces on PREFETCH_TABLE_READERS of the prefetch's threads: with one, a table piece
    waits while that thread is held on the piece before it, and the other threads have ended."""
    blocked = tmp_path / "slow"
    os.mkfifo(blocked)  # its open blocks until a writer opens it: the one table reader held there
    other, table = tmp_path / "other.bin", tmp_path / "table.bin"
    for path in (other, table):
        path.write_bytes(os.urandom(4 * MiB))
    drop_from_page_cache([str(other), str(table)])

    reading = ReadAhead("table readers", [(str(other), 0, 4 * MiB), (str(blocked), 0, 4096),
                                          (str(table), 0, 4 * MiB)], 3, last=2, last_readers=1)
    deadline = time.time() + 10
    while cached_bytes(other) < STILL_CACHED * 4 * MiB and time.time() < deadline:
        time.sleep(0.05)
    time.sleep(0.5)
    assert cached_bytes(other) >= STILL_CACHED * 4 * MiB
    assert cached_bytes(table) == 0 and not reading.done.is_set()
    assert len([t for t in threading.enumerate() if t.name == reading.what]) == 1

    os.close(os.open(blocked, os.O_WRONLY))  # the held open returns; a pipe cannot be read at an offset
    assert reading.join(30) and reading.error is not None


def test_the_probe_reads_pages_then_weights_each_way_or_says_why_not(tmp_path, tiny_model):
    """scripts/probe_read_ahead_beside_python.py, from a dropped page cache, alone and beside Python: the layout
    ends up in the page cache each way; a way it cannot parse is one line and exit 2."""
    layout = tmp_path / "tiny-llama"
    write_layout(tiny_model("tiny-llama"), str(layout), dtype="float32", file_bytes=200_000, progress=False)
    repo, out = Path(__file__).resolve().parents[1], tmp_path / "probe.json"
    done = subprocess.run([sys.executable, "scripts/probe_read_ahead_beside_python.py", str(layout), "--ways",
                           "alone,busy:si=0.5", "--rounds", "1", "--out", str(out)], cwd=repo,
                          capture_output=True, text=True, timeout=120)
    if done.returncode == 2 and "cannot drop the page cache" in done.stderr:
        pytest.skip(done.stderr.strip())
    assert done.returncode == 0, done.stderr
    report = json.loads(out.read_text())
    assert set(report["median"]) == {"alone", "busy:si=0.5"}
    assert all(m["weights_s"] > 0 and m["start_pages_s"] == 0 for m in report["median"].values())
    assert cached_fraction([path for path, _ in prefetch.layout_files(str(layout))]) >= STILL_CACHED
    bad = subprocess.run([sys.executable, "scripts/probe_read_ahead_beside_python.py", str(layout), "--ways",
                          "busy:si=0"], cwd=repo, capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and len(bad.stderr.strip().splitlines()) == 1 and "si=0" in bad.stderr


def test_a_narrowed_read_ahead_reads_with_its_first_threads_until_widened(tmp_path):
    """The weights' prefetch during a restore (PREFETCH_RESTORE_READERS): the threads held back start only with
    widen(), and a widen after the end starts nothing."""
    blocked = tmp_path / "first"
    os.mkfifo(blocked)  # the one first thread hangs opening it
    weights = tmp_path / "weights.bin"
    weights.write_bytes(os.urandom(4 * MiB))
    drop_from_page_cache([str(weights)])

    narrow = ReadAhead("weights prefetch", [(str(blocked), 0, 4096), (str(weights), 0, 4 * MiB)], 3,
                       first_readers=1)
    time.sleep(0.5)
    assert cached_bytes(weights) == 0  # the only thread waits on the first piece
    narrow.widen()
    deadline = time.time() + 10
    while cached_bytes(weights) < STILL_CACHED * 4 * MiB and time.time() < deadline:
        time.sleep(0.05)
    assert cached_bytes(weights) >= STILL_CACHED * 4 * MiB and not narrow.done.is_set()
    os.close(os.open(blocked, os.O_WRONLY))
    assert narrow.join(10) and narrow.error is not None  # a pipe cannot be read at an offset
    time.sleep(0.2)  # the threads return right after the end
    narrow.widen()
    assert not [t for t in threading.enumerate() if t.name == narrow.what]
