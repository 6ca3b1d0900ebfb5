"""Where the threads of some processes wait while a command runs: every --every seconds, for each process whose
command line holds --match, each thread's kernel wait channel and kernel stack (/proc/PID/task/TID/wchan,
/stack) and, where py-spy is on the PATH, its Python and native frames (`py-spy dump --native`, which names
Python's threads). So that a start's thread that takes seconds on little CPU (the `early_kernels_` fields of a
boot log's cuda_graphs detail, docs/bench.md) shows what it waits on: a file read, a lock, the GPU driver.

    python scripts/sample_thread_stacks.py --match snapshots.frozen --every 1 --out stacks.json -- \\
        faas-bench coldstart ... --modes process --page-cache dropped --repeat 1
    python scripts/sample_thread_stacks.py --summarize stacks.json --thread graph-kernels

Run as root (another process's kernel stack, and py-spy's ptrace). py-spy stops the process for the time of a
dump (tens of milliseconds), so the samples slow what they watch a little. Writes {"command", "every_s",
"samples": [{"s" (since the command began), "pid", "threads": {TID: {"comm", "wchan", "kernel_stack"}}, "py_spy"
(its dump's text, or why there is none)}]}. Exit 2 with one line on bad input; otherwise the command's exit
status.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path


def matching_pids(match: str) -> list[str]:
    found, own = [], str(os.getpid())
    for pid in filter(str.isdigit, os.listdir("/proc")):
        if pid == own:  # its own command line holds the match too
            continue
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                if match.encode() in f.read():
                    found.append(pid)
        except OSError:
            continue
    return found


def _read(path: str) -> str:
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError as exc:
        return f"({exc.strerror or exc})"


def kernel_waits(pid: str) -> dict[str, dict[str, str]]:
    threads = {}
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return threads
    for tid in tids:
        threads[tid] = {"comm": _read(f"/proc/{pid}/task/{tid}/comm"), "wchan": _read(f"/proc/{pid}/task/{tid}/wchan"),
                        "kernel_stack": _read(f"/proc/{pid}/task/{tid}/stack")}
    return threads


def py_spy_dump(pid: str, py_spy: str | None) -> str:
    if py_spy is None:
        return "(no py-spy on the PATH)"
    try:
        done = subprocess.run([py_spy, "dump", "--native", "--pid", pid], capture_output=True, text=True, timeout=10)
    except subprocess.TimeoutExpired:
        return "(py-spy took over 10 s)"
    return done.stdout if done.returncode == 0 else f"(py-spy: {done.stderr.strip()[:300]})"


def sample(command: list[str], match: str, every: float) -> tuple[int, dict]:
    py_spy = shutil.which("py-spy")
    samples: list[dict] = []
    began = time.monotonic()
    stop = threading.Event()

    def watch() -> None:
        while not stop.is_set():
            at = time.monotonic() - began
            for pid in matching_pids(match):
                samples.append({"s": round(at, 3), "pid": int(pid), "threads": kernel_waits(pid),
                                "py_spy": py_spy_dump(pid, py_spy)})
            stop.wait(max(0.0, every - (time.monotonic() - began - at)))

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    try:
        rc = subprocess.call(command)
    finally:
        stop.set()
        watcher.join()
    return rc, {"command": command, "match": match, "every_s": every, "samples": samples}


def thread_frames(dump: str, thread: str) -> tuple[str | None, list[str]]:
    """(its thread id, the frames py-spy printed) for Python thread THREAD (by name), innermost first."""
    tid, frames, inside = None, [], False
    for line in dump.splitlines():
        if line.startswith("Thread "):
            inside = f'"{thread}"' in line
            tid = line.split()[1] if inside else tid
        elif inside and line.startswith(" "):
            frames.append(line.strip())
    return tid, frames


def summarize(report: dict, thread: str, depth: int) -> None:
    for s in report["samples"]:
        tid, frames = thread_frames(s["py_spy"], thread)
        if not frames:
            continue
        kernel = s["threads"].get(tid, {})
        print(f"{s['s']:7.2f} s  pid {s['pid']}  thread {tid}  waits in the kernel at {kernel.get('wchan', '?')}: "
              f"{' < '.join(kernel.get('kernel_stack', '').split(chr(10))[:4])}")
        for frame in frames[:depth]:
            print(f"           {re.sub(r' +', ' ', frame)[:160]}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--match", help="a string in the command line of the processes to watch")
    parser.add_argument("--every", type=float, default=1.0, help="seconds between samples (default 1)")
    parser.add_argument("--out", type=Path, help="where the samples go (JSON)")
    parser.add_argument("--summarize", type=Path, help="print a written report's samples of --thread instead")
    parser.add_argument("--thread", default="graph-kernels", help="Python thread name to summarize")
    parser.add_argument("--depth", type=int, default=12, help="frames per sample in the summary")
    parser.add_argument("command", nargs="*", help="the command to run (after --)")
    args = parser.parse_args(argv)
    if args.summarize is not None:
        try:
            summarize(json.loads(args.summarize.read_text()), args.thread, args.depth)
        except (OSError, ValueError, KeyError) as exc:
            print(f"sample_thread_stacks: {args.summarize}: {exc}", file=sys.stderr)
            return 2
        return 0
    if not args.command or not args.match or args.out is None or args.every <= 0:
        print("sample_thread_stacks: give --match, --out, a positive --every and a command after --", file=sys.stderr)
        return 2
    rc, report = sample(args.command, args.match, args.every)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report))
    print(f"sample_thread_stacks: {len(report['samples'])} samples written to {args.out}")
    return rc


if __name__ == "__main__":
    sys.exit(main())
