"""The page-cache residency a process restore decides by (runtime/weights/residency.py), on real files."""

from __future__ import annotations

import os

from runtime.weights.residency import cached_fraction, files_in


def test_files_just_written_are_cached_and_dropped_pages_are_not(tmp_path):
    data = os.urandom(4 << 20)
    for name in ("a.bin", "b.bin"):
        (tmp_path / name).write_bytes(data)
    files = files_in(tmp_path)
    fraction = cached_fraction(files)
    if fraction is None:  # a kernel older than 6.5 cannot say: the restore then streams through its helper
        return
    assert fraction > 0.99
    fd = os.open(files[0], os.O_RDONLY)
    try:
        os.fsync(fd)  # clean pages can be dropped; dirty ones cannot
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)
    assert 0.4 < cached_fraction(files) < 0.6
    assert cached_fraction([]) == 1.0
    assert cached_fraction([tmp_path / "gone.bin"]) is None


def test_a_large_file_is_asked_about_in_windows_over_its_whole_length(tmp_path):
    """A 200 MiB file: its windows cover its start and end, so a half or a tail out of the cache shows."""
    path = tmp_path / "weights.bin"
    with open(path, "wb") as f:
        for _ in range(50):
            f.write(os.urandom(4 << 20))
    if cached_fraction([path]) is None:
        return  # a kernel older than 6.5 cannot say
    assert cached_fraction([path]) > 0.99
    size = path.stat().st_size
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, size // 2, 0, os.POSIX_FADV_DONTNEED)  # the second half
        assert 0.45 < cached_fraction([path]) < 0.55
        os.pread(fd, size, 0)  # all back
        os.posix_fadvise(fd, size - (8 << 20), 0, os.POSIX_FADV_DONTNEED)  # but the last 8 MiB
        assert 0.9 < cached_fraction([path]) < 1.0  # the last window sees the missing tail
    finally:
        os.close(fd)


def test_the_page_cache_by_file_script_names_what_is_cached(tmp_path):
    """scripts/page_cache_by_file.py, run as after a start: a file read is listed with its bytes, one dropped
    from the page cache is not; a folder that does not exist is one line and exit 2."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    from runtime.weights.residency import cached_bytes

    read, dropped = tmp_path / "read.bin", tmp_path / "dropped.bin"
    for path in (read, dropped):
        path.write_bytes(os.urandom(2 << 20))
    fd = os.open(dropped, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)
    if cached_bytes(read) is None:
        return  # a kernel older than 6.5 cannot say
    if cached_bytes(dropped):
        return  # this machine's page cache keeps the file after POSIX_FADV_DONTNEED
    repo = Path(__file__).resolve().parents[1]
    out = tmp_path / "cached.json"
    done = subprocess.run([sys.executable, "scripts/page_cache_by_file.py", str(tmp_path), "--json", str(out)],
                          cwd=repo, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert str(read) in done.stdout and str(dropped) not in done.stdout
    assert json.loads(out.read_text()) == {str(read): 2 << 20}
    bad = subprocess.run([sys.executable, "scripts/page_cache_by_file.py", str(tmp_path / "nowhere")], cwd=repo,
                         capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and len(bad.stderr.strip().splitlines()) == 1 and "nowhere" in bad.stderr
