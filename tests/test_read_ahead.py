"""The threaded page-cache reader the entry point starts (runtime/read_ahead.py): a read-ahead given another
to come after (the weights after the start pages) reads nothing until that one has ended, then reads all of it;
a piece it cannot read ends that share with the reason, not the process."""

from __future__ import annotations

import os
import time

from runtime.read_ahead import ReadAhead
from runtime.weights.residency import cached_bytes
from tests.test_weights_prefetch import drop_from_page_cache

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
    assert cached_bytes(weights) == 4 * MiB
    assert second.bytes == 4 * MiB and second.ended >= first.ended
