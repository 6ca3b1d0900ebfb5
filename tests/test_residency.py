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
