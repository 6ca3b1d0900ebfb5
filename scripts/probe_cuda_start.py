"""Where a fresh process's first CUDA work goes: the driver's load, `cuInit`, the primary context, and the
first cuBLAS product and torch kernels a first prefill runs, each in fresh processes, median of --repeat.

A restored process snapshot holds no CUDA state (docs/snapshots.md), so it pays all of this after the
restore: this probe says which part is which, whether a context another process holds (a restore helper's)
makes a new one cheaper, whether a process that has just freed most of the device's memory (as the instance
before a benchmark's start has) makes the next context slower, and whether a process that has just written a
heap the size of the runtime's image into fresh memory (what CRIU's restore does) makes its context more
slowly. Where criu can checkpoint here (root, criu installed), the same processes are also checkpointed once
parked and their context made after CRIU restored them, as a process snapshot's runtime makes its own (on a
GPU machine it is baked without a pid namespace of its own: snapshots/process.py). For each context: its
thread's CPU time and the part in the kernel, its page faults and waits, and how much resident memory it
added.

    python scripts/probe_cuda_start.py --repeat 5 --out cuda-start-h100.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from snapshots.criu import Criu, find_criu, restore_blockers  # noqa: E402
from snapshots.restore_run import CRIU_OPTIONS, set_subreaper  # noqa: E402

DRIVER = r"""
import ctypes, json, mmap, os, resource, sys, time
if {own_session}:
    os.setsid()  # CRIU checkpoints a tree whose root called setsid(): its own process group
if {torch}:
    import torch
if {heap_mib}:
    heap = mmap.mmap(-1, {heap_mib} << 20)
    for page in range(0, {heap_mib} << 20, mmap.PAGESIZE):
        heap[page] = 1
def resident_mib():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * mmap.PAGESIZE / 2**20
print("parked", flush=True)
{wait}
t0 = time.perf_counter()
cu = ctypes.CDLL("libcuda.so.1")
t1 = time.perf_counter()
assert cu.cuInit(0) == 0
t2 = time.perf_counter()
u0, r0 = resource.getrusage(resource.RUSAGE_THREAD), resident_mib()
dev, ctx = ctypes.c_int(), ctypes.c_void_p()
assert cu.cuDeviceGet(ctypes.byref(dev), 0) == 0
assert cu.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), dev) == 0
t3 = time.perf_counter()
u1, r1 = resource.getrusage(resource.RUSAGE_THREAD), resident_mib()
assert cu.cuCtxSetCurrent(ctx) == 0
ptr = ctypes.c_uint64()
assert cu.cuMemAlloc_v2(ctypes.byref(ptr), 1 << 20) == 0
t4 = time.perf_counter()
print(json.dumps({{"dlopen_s": t1 - t0, "cuinit_s": t2 - t1, "context_s": t3 - t2, "first_alloc_s": t4 - t3,
                  "context_cpu_s": u1.ru_utime + u1.ru_stime - u0.ru_utime - u0.ru_stime,
                  "context_system_s": u1.ru_stime - u0.ru_stime, "context_faults": u1.ru_minflt - u0.ru_minflt,
                  "context_waits": u1.ru_nvcsw - u0.ru_nvcsw, "context_resident_mib": r1 - r0}}))
"""

TORCH = r"""
import json, time
import torch
def timed(fn):
    start = time.perf_counter(); fn(); torch.cuda.synchronize(); return time.perf_counter() - start
out = {{}}
out["context_s"] = timed(lambda: torch.empty(1, device="cuda"))
x = torch.randn(161, {hidden}, device="cuda", dtype=torch.bfloat16)
w = torch.randn({qkv}, {hidden}, device="cuda", dtype=torch.bfloat16)
w2 = torch.randn({inter}, {hidden}, device="cuda", dtype=torch.bfloat16)
torch.cuda.synchronize()
out["first_matmul_s"] = timed(lambda: x @ w.t())
out["same_matmul_again_s"] = timed(lambda: x @ w.t())
out["new_shape_matmul_s"] = timed(lambda: x @ w2.t())
logits = torch.randn(1, 151936, device="cuda", dtype=torch.bfloat16)
out["first_softmax_s"] = timed(lambda: torch.softmax(logits.float(), -1))
out["first_argmax_s"] = timed(lambda: logits.argmax(-1))
print(json.dumps(out))
"""

HOLD = r"""
import ctypes, sys, time
cu = ctypes.CDLL("libcuda.so.1")
cu.cuInit(0)
if {context}:
    dev, ctx = ctypes.c_int(), ctypes.c_void_p()
    cu.cuDeviceGet(ctypes.byref(dev), 0)
    cu.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), dev)
print("held", flush=True)
sys.stdin.read()
"""


TENANT = r"""
import ctypes
cu = ctypes.CDLL("libcuda.so.1")
assert cu.cuInit(0) == 0
dev, ctx = ctypes.c_int(), ctypes.c_void_p()
assert cu.cuDeviceGet(ctypes.byref(dev), 0) == 0
assert cu.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), dev) == 0
assert cu.cuCtxSetCurrent(ctx) == 0
ptr, gib = ctypes.c_uint64(), 0
while gib < {gib} and cu.cuMemAlloc_v2(ctypes.byref(ptr), 1 << 30) == 0:
    gib += 1
print(gib)
"""


def driver(torch: bool, heap_mib: int = 0, wait: str = "") -> str:
    """The driver probe's code: after importing torch or not, and after writing HEAP_MIB of fresh memory, it
    parks until the code WAIT returns (after setsid(), so that CRIU can checkpoint it), then
    makes its context."""
    return DRIVER.format(torch=torch, heap_mib=heap_mib, wait=wait, own_session=bool(wait))


def run(code: str) -> dict:
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    if done.returncode != 0:
        raise SystemExit(f"probe_cuda_start: a probe failed: {done.stderr.strip()[-400:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def restored(criu: Criu, torch: bool, heap_mib: int) -> dict:
    """The driver probe parked, checkpointed by criu (which ends it), restored, then let go: the figures of
    its context made after the restore, with criu's restore time."""
    with tempfile.TemporaryDirectory(prefix="probe-cuda-restored-") as work:
        work = Path(work)
        go, out, images = work / "go", work / "out.txt", work / "images"
        code = driver(torch, heap_mib, wait=f"while not os.path.exists({str(go)!r}): time.sleep(0.001)")
        command = [sys.executable, "-c", code]
        with open(out, "wb") as log:
            # cwd "/": criu restores the working directory, which the temporary one would not be for long
            process = subprocess.Popen(command, cwd="/", stdin=subprocess.DEVNULL, stdout=log,
                                       stderr=subprocess.STDOUT)
        try:
            deadline = time.monotonic() + 120
            while b"parked" not in out.read_bytes():
                if process.poll() is not None or time.monotonic() > deadline:
                    raise SystemExit(f"probe_cuda_start: the probe did not park: {out.read_text()[-400:]}")
                time.sleep(0.01)
            images.mkdir()
            criu.run(["dump", "-t", str(process.pid), "-D", str(images), *CRIU_OPTIONS], work / "dump.log")
        finally:
            process.kill()
            process.wait()
        started = time.perf_counter()
        criu.run(["restore", "-d", "-D", str(images), "--pidfile", str(work / "pid"), *CRIU_OPTIONS],
                 work / "restore.log")
        restore_s = time.perf_counter() - started
        go.touch()
        _, status = os.waitpid(int((work / "pid").read_text()), 0)  # our child: we are its subreaper
        lines = out.read_text().strip().splitlines()
        if status != 0:
            raise SystemExit(f"probe_cuda_start: a restored probe failed: {lines[-5:]}")
        return {**json.loads(lines[-1]), "restore_s": restore_s}


def restored_arms(heap_mib: int, repeat: int) -> dict:
    """The arms that need criu, or why they did not run."""
    criu = find_criu()
    blockers = restore_blockers(criu)
    if criu is None or blockers:
        return {"restored_arms_not_run": blockers or ["no criu found"]}
    set_subreaper()  # each restored probe becomes our child
    heap = f"import torch and {heap_mib} MiB written"
    return {
        "driver_restored": repeated(
            "driver restored by criu", lambda: restored(criu, False, 0), repeat),
        "driver_restored_after_torch_import_and_a_written_heap": repeated(
            f"driver restored by criu after {heap}", lambda: restored(criu, True, heap_mib), repeat),
    }


def medians(runs: list[dict]) -> dict:
    return {key: round(statistics.median(r[key] for r in runs), 4) for key in runs[0]}


def measure(name: str, code: str, repeat: int) -> dict:
    return repeated(name, lambda: run(code), repeat)


def repeated(name: str, take: Callable[[], dict], repeat: int) -> dict:
    runs = []
    for i in range(repeat):
        print(f"probe_cuda_start: {name} {i + 1}/{repeat}", file=sys.stderr, flush=True)
        runs.append(take())
    return {"median": medians(runs), "runs": runs}


def after_a_tenant(gib: int, gap_s: float) -> dict:
    """The driver probe started GAP_S after another process that held GIB of device memory has exited, as a
    start follows the instance before it (whose KV cache takes most of the GPU's memory) in a benchmark."""
    tenant = subprocess.run([sys.executable, "-c", TENANT.format(gib=gib)], capture_output=True, text=True,
                            timeout=300)
    if tenant.returncode != 0:
        raise SystemExit(f"probe_cuda_start: the tenant failed: {tenant.stderr.strip()[-400:]}")
    time.sleep(gap_s)
    return {**run(driver(torch=False)), "tenant_gib": int(tenant.stdout.strip() or 0)}


def beside_another_process(name: str, code: str, context: bool, repeat: int) -> dict:
    """CODE's figures while another process has run cuInit and (CONTEXT) holds a context on the GPU."""
    holder = subprocess.Popen([sys.executable, "-c", HOLD.format(context=context)], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        return measure(name, code, repeat)
    finally:
        holder.stdin.close()
        holder.wait(timeout=60)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--hidden", type=int, default=1536, help="the first prefill's product: [161, hidden]")
    parser.add_argument("--qkv", type=int, default=2048)
    parser.add_argument("--inter", type=int, default=17920)
    parser.add_argument("--heap-mib", type=int, default=293,
                        help="fresh memory written before the context in one arm: the process image's size")
    parser.add_argument("--tenant-gib", type=int, default=120,
                        help="device memory a process holds and frees just before one arm's: a KV cache's size")
    parser.add_argument("--out", type=Path, default=Path("cuda-start.json"))
    args = parser.parse_args()
    result = {
        "date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
        "command": sys.argv,
        "driver": measure("driver", driver(torch=False), args.repeat),
        "driver_after_torch_import": measure("driver after import torch", driver(torch=True), args.repeat),
        "driver_after_torch_import_and_a_written_heap": measure(
            f"driver after import torch and {args.heap_mib} MiB written", driver(True, args.heap_mib), args.repeat),
        "driver_beside_a_held_context": beside_another_process(
            "driver beside a held context", driver(torch=False), True, args.repeat),
        "driver_after_torch_import_beside_a_held_context": beside_another_process(
            "driver after import torch beside a held context", driver(torch=True), True, args.repeat),
        "driver_beside_a_process_after_cuinit": beside_another_process(
            "driver beside a process that ran cuInit only", driver(torch=False), False, args.repeat),
        "driver_right_after_a_process_freed_memory": repeated(
            f"driver right after a process freed {args.tenant_gib} GiB", lambda: after_a_tenant(args.tenant_gib, 0),
            args.repeat),
        "driver_3s_after_a_process_freed_memory": repeated(
            f"driver 3 s after a process freed {args.tenant_gib} GiB", lambda: after_a_tenant(args.tenant_gib, 3),
            args.repeat),
        "torch_first_ops": measure("torch first ops", TORCH.format(hidden=args.hidden, qkv=args.qkv,
                                                                   inter=args.inter), args.repeat),
        **restored_arms(args.heap_mib, args.repeat),
    }
    for key in (k for k in result if isinstance(result[k], dict)):
        print(f"{key:<48} " + "  ".join(f"{k} {v * 1e3:.1f} ms" if k.endswith("_s") else f"{k} {v:g}"
                                         for k, v in result[key]["median"].items()))
    if "restored_arms_not_run" in result:
        print("restored arms not run: " + "; ".join(result["restored_arms_not_run"]))
    args.out.write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
