"""How fast fresh anonymous memory is first written, pass after pass: each pass maps --gib of anonymous memory,
writes every page of it (64 MiB copies of zeros) and unmaps it, after waiting the pass's idle seconds. In a VM
whose balloon reports free pages to its host (virtio-balloon's free page reporting), memory freed and left idle
goes back to the host, and the next first write of it costs a fault on the host as well as in the guest; memory
freed just before is still backed. A restore writes its whole image into fresh memory: a start after an idle
spell may pay this where the next start does not.

    python scripts/probe_memory_first_touch.py --gib 16 --idle 0,0,60,0 --out memory-first-touch-cpu-16gib.json

--idle gives each pass's wait before it, in seconds (one pass per value). Exit 2 with one line on bad input.
"""

from __future__ import annotations

import argparse
import json
import mmap
import sys
import time
from pathlib import Path

GiB = 1 << 30
WRITE_BYTES = 64 << 20
#: virtio-balloon's feature bit for free page reporting (VIRTIO_BALLOON_F_REPORTING)
FREE_PAGE_REPORTING = 5
BALLOON_DRIVER = Path("/sys/bus/virtio/drivers/virtio_balloon")


def first_write_seconds(size: int) -> float:
    """Seconds to map SIZE bytes of fresh anonymous memory and write every page of it once."""
    zeros = bytes(WRITE_BYTES)
    started = time.perf_counter()
    memory = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    try:
        for offset in range(0, size, WRITE_BYTES):
            memory[offset:offset + WRITE_BYTES] = zeros[:min(WRITE_BYTES, size - offset)]
        return time.perf_counter() - started
    finally:
        memory.close()


def free_page_reporting() -> bool | None:
    """Whether a virtio balloon of this machine reports free pages to its host; None without one."""
    features = [(device / "features").read_text().strip() for device in BALLOON_DRIVER.glob("virtio*")]
    if not features:
        return None
    return any(bits[FREE_PAGE_REPORTING:FREE_PAGE_REPORTING + 1] == "1" for bits in features)


def idle_list(text: str) -> list[float]:
    try:
        values = [float(v) for v in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a list of seconds: {text!r}") from None
    if not values or any(v < 0 for v in values):
        raise argparse.ArgumentTypeError(f"not a list of seconds, each at least 0: {text!r}")
    return values


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--gib", type=float, default=4.0, help="memory written per pass (GiB)")
    parser.add_argument("--idle", type=idle_list, default=[0.0, 0.0, 20.0, 0.0],
                        help="seconds to wait before each pass, comma-separated")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args(argv)
    size = int(args.gib * GiB) // mmap.PAGESIZE * mmap.PAGESIZE
    if size <= 0:
        print(f"probe_memory_first_touch: --gib {args.gib} is less than a page", file=sys.stderr)
        return 2
    passes = []
    for number, idle in enumerate(args.idle, 1):
        time.sleep(idle)
        seconds = first_write_seconds(size)
        passes.append({"idle_before_s": idle, "seconds": round(seconds, 4), "gib_s": round(size / GiB / seconds, 3)})
        print(f"pass {number} after {idle:g} s idle: {size / GiB:.2f} GiB written in {seconds:.3f} s "
              f"({size / GiB / seconds:.2f} GiB/s)", flush=True)
    record = {"bytes": size, "free_page_reporting": free_page_reporting(), "passes": passes}
    if args.out:
        args.out.write_text(json.dumps(record, indent=2) + "\n")
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
