"""The pool budgets of `faas-bench switch`'s instances, and the settings that give an instance one: on the
host POOL_MEMORY_GB is the budget itself; on a GPU the pool gets GPU_MEMORY_UTILIZATION of the device less
what is in use when it is made (the CUDA context), so a budget is set by a share and read back from /health."""

from __future__ import annotations

import shutil
import subprocess

from runtime.bench import BenchError

GiB = 1 << 30
#: what the CUDA context and the engines' own buffers take beside the pool, kept out of its budget
_CUDA_MARGIN = 2 * GiB
#: the share of a GPU an instance whose pool must hold what it is given may use
ROOMY_SHARE = 0.9


def default_pool_bytes(sizes: list[int]) -> int:
    """Room for the largest model two and a half times (two models and their KV caches) or for 60% of all
    the models, whichever is more: less than all of them, so that switches evict."""
    return max(5 * max(sizes) // 2, 3 * sum(sizes) // 5)


def pool_budget(pool_bytes: int, device: str) -> dict[str, str]:
    """The settings that give the instance's pool `pool_bytes`: POOL_MEMORY_GB on the host; on a GPU the
    GPU_MEMORY_UTILIZATION that leaves that much beside the CUDA context."""
    total = gpu_memory_bytes() if device != "cpu" else None
    if total is None:
        return {"POOL_MEMORY_GB": f"{pool_bytes / GiB:.6f}"}
    share = (pool_bytes + _CUDA_MARGIN) / total
    if share > 1:
        raise BenchError(f"a pool of {pool_bytes / GiB:.1f} GiB does not fit the GPU's {total / GiB:.1f} GiB")
    return {"GPU_MEMORY_UTILIZATION": f"{share:.4f}"}


def roomy_budget(pool_bytes: int, device: str) -> dict[str, str]:
    """Settings of a pool of at least `pool_bytes`: that much on the host, ROOMY_SHARE of the GPU."""
    if device != "cpu" and gpu_memory_bytes() is not None:
        return {"GPU_MEMORY_UTILIZATION": f"{ROOMY_SHARE}"}
    return {"POOL_MEMORY_GB": f"{pool_bytes / GiB:.6f}"}


def budget_like(reference: dict[str, str], reference_bytes: int, pool_bytes: int) -> dict[str, str]:
    """The settings that give a pool `pool_bytes` in an instance started like one whose settings REFERENCE
    gave a pool of `reference_bytes` (/health `budget_bytes`): on a GPU the share moves by the difference,
    since what the device has in use when the pool is made is the same in both."""
    if "GPU_MEMORY_UTILIZATION" not in reference:
        return {"POOL_MEMORY_GB": f"{pool_bytes / GiB:.9f}"}
    total = gpu_memory_bytes()
    if total is None:
        raise BenchError("the GPU's memory cannot be read (nvidia-smi)")
    share = float(reference["GPU_MEMORY_UTILIZATION"]) + (pool_bytes - reference_bytes) / total
    if not 0 < share <= 1:
        raise BenchError(f"a pool of {pool_bytes / GiB:.2f} GiB does not fit the GPU's {total / GiB:.1f} GiB")
    return {"GPU_MEMORY_UTILIZATION": f"{share:.7f}"}


def gpu_memory_bytes() -> int | None:
    if shutil.which("nvidia-smi") is None:
        return None
    out = subprocess.run(["nvidia-smi", "--query-gpu=memory.total", "--format=csv,noheader,nounits"],
                         capture_output=True, text=True, timeout=20)
    lines = out.stdout.split()
    return int(lines[0]) * 2**20 if out.returncode == 0 and lines else None
