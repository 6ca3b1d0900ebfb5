"""How long checking a snapshot's files takes while the interpreter's main thread is busy.

At a process restore the image files are hashed on threads (snapshots/integrity.py) while the main thread
imports the bootstrap: every time a hashing thread comes back from a call that released the GIL it waits for
the main thread to give the GIL up (the switch interval, 5 ms). This script writes FILES files of MIB MiB
(random bytes, in the page cache), then times `file_digests` over them, alone and beside a thread that runs
Python bytecode without pause, ROUNDS times each, and prints the medians as JSON.

    python scripts/bench_digest_contention.py --mib 300 --files 1 --rounds 5
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from runtime.weights.file_digest import file_digests  # noqa: E402
from snapshots.integrity import HASH  # noqa: E402


def busy(stop: threading.Event) -> None:
    n = 0
    while not stop.is_set():
        n += sum(i * i for i in range(200))


def timed(paths: list[Path], beside_busy: bool) -> float:
    stop = threading.Event()
    thread = threading.Thread(target=busy, args=(stop,), daemon=True) if beside_busy else None
    if thread is not None:
        thread.start()
        time.sleep(0.02)
    try:
        started = time.perf_counter()
        file_digests(paths, HASH)
        return time.perf_counter() - started
    finally:
        stop.set()
        if thread is not None:
            thread.join()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mib", type=int, default=300, help="MiB per file (300: a process image's page file)")
    parser.add_argument("--files", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        paths = []
        for i in range(args.files):
            path = Path(tmp) / f"pages-{i}.img"
            with open(path, "wb") as f:
                for _ in range(args.mib):
                    f.write(os.urandom(1 << 20))
            paths.append(path)
        file_digests(paths, HASH)  # both kinds of round find the files in the page cache
        result = {"hash": HASH, "bytes": args.mib * args.files << 20, "cpus": os.cpu_count(),
                  "switch_interval_s": sys.getswitchinterval()}
        for name, beside in (("alone_s", False), ("beside_busy_thread_s", True)):
            result[name] = round(statistics.median(timed(paths, beside) for _ in range(args.rounds)), 4)
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
