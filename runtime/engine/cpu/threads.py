"""How many threads torch runs on the CPU: the CPUs this process may use, bounded by its cgroup's CPU quota.

torch starts one thread per CPU it sees, but a container (a Lambda function, a Docker --cpus limit) may see
more CPUs than its quota pays for: the extra threads are then throttled in the middle of each parallel
region, and the whole region waits for them.
"""

from __future__ import annotations

import math
import os
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

import torch

CGROUP = Path("/sys/fs/cgroup")


def cpu_quota(root: Path = CGROUP) -> float | None:
    """CPUs' worth of time per period the cgroup allows (v2's cpu.max of this process's cgroup, else of the
    root a container sees; else v1's cfs quota); None: unlimited."""
    own = _own_cgroup()
    for folder in ([root / own] if own else []) + [root]:
        v2 = folder / "cpu.max"
        if v2.is_file():
            quota, _, period = v2.read_text().partition(" ")
            return None if quota == "max" else int(quota) / int(period)
    v1 = root / "cpu" / "cpu.cfs_quota_us"
    if v1.is_file():
        quota = int(v1.read_text())
        return None if quota <= 0 else quota / int((root / "cpu" / "cpu.cfs_period_us").read_text())
    return None


def cpu_threads(root: Path = CGROUP) -> int:
    """The CPUs of this process's affinity, at most its quota rounded up, at least one."""
    available = len(os.sched_getaffinity(0))
    quota = cpu_quota(root)
    return max(1, min(available, math.ceil(quota))) if quota else available


def _own_cgroup() -> str | None:
    """This process's cgroup v2 path relative to the hierarchy's root ("0::/a/b" in /proc/self/cgroup)."""
    try:
        lines = Path("/proc/self/cgroup").read_text().splitlines()
    except OSError:
        return None
    own = next((line[3:] for line in lines if line.startswith("0::")), "/").strip("/")
    return own or None


@contextmanager
def ops_on_one_thread() -> Iterator[None]:
    """torch's ops on one thread for the duration: in a decode step of a few tokens each op is so small that a
    parallel region's fork and join cost more than its work. The packed projections, the step's real work,
    keep their own threads (runtime/engine/cpu/packed.py)."""
    threads = torch.get_num_threads()
    if threads == 1:
        yield
        return
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)
