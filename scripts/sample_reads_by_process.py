"""Which processes read from the disk while a command runs: every process's `read_bytes` (/proc/PID/io, the
bytes it made the kernel fetch from storage: its reads, its page faults and the read-ahead around them) sampled
every --every seconds, so that a start's reads can be split between the entry point (the start pages and the
weights' prefetch), criu's restore, the restored runtime's faults, the weights' helper and the driver primer.

    python scripts/sample_reads_by_process.py --out reads.json -- faas-bench coldstart ... --page-cache dropped
    python scripts/sample_reads_by_process.py --summarize reads.json

Run as root to see every process (another user's /proc/PID/io is unreadable). The kernel adds to a process's
count what its exited threads and its reaped children read; the summary's `own` takes away the children's,
as last sampled. A process that exits between two samples keeps what it had read at the last one.

Writes {"command", "every_s", "began_at" (time.time() when it began), "processes": [{"pid", "ppid" (its parent
as last seen), "command" (its command line as last seen, cut to 300 characters), "first_s", "last_s" (seconds
since the command began, first and last seen), "reads": [[seconds, read_bytes], ...] (at each change)}]}. Exit 2
with one line on bad input; otherwise the command's exit status.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

MiB = 1 << 20


def read_bytes(pid: str) -> int | None:
    """PID's read_bytes, or None once it has exited or where it cannot be read."""
    try:
        with open(f"/proc/{pid}/io") as f:
            for line in f:
                if line.startswith("read_bytes:"):
                    return int(line.split()[1])
    except (OSError, ValueError):
        return None
    return None


def parent_and_start(pid: str) -> tuple[int, int]:
    """PID's parent and its start time (clock ticks since boot: with the pid, it names one process)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return int(fields[1]), int(fields[19])
    except (OSError, ValueError, IndexError):
        return 0, 0


def command_line(pid: str) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace").strip()[:300]
    except OSError:
        return ""


class Sampler:
    def __init__(self, every: float) -> None:
        self.every = every
        self.began = time.time()
        self.processes: dict[tuple[str, int], dict] = {}  # by pid and start time: pids are reused
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="sample-reads", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> dict:
        self._stop.set()
        self._thread.join()
        return {"every_s": self.every, "began_at": self.began, "processes": list(self.processes.values())}

    def _run(self) -> None:
        while not self._stop.is_set():
            self.sample()
            self._stop.wait(self.every)
        self.sample()

    def sample(self) -> None:
        now = round(time.time() - self.began, 3)
        for pid in os.listdir("/proc"):
            if not pid.isdigit():
                continue
            nbytes = read_bytes(pid)
            if nbytes is None:
                continue
            ppid, started = parent_and_start(pid)
            record = self.processes.setdefault((pid, started), {"pid": int(pid), "first_s": now, "reads": []})
            record["last_s"] = now
            record["ppid"] = ppid  # as last seen: an orphan's reaper is its parent then
            record["command"] = command_line(pid) or record.get("command", "")  # after an exec, the new one
            if not record["reads"] or record["reads"][-1][1] != nbytes:
                record["reads"].append([now, nbytes])


def own_reads(processes: list[dict]) -> list[tuple[int, int, dict]]:
    """(own bytes, bytes counted, process) of each process: counted, less what its children that exited while it
    was seen had counted at their last sample."""
    def counted(p: dict) -> int:
        return p["reads"][-1][1] if p["reads"] else 0

    rows = []
    for p in processes:
        reaped = sum(counted(c) for c in processes if c.get("ppid") == p["pid"] and c is not p
                     and p["first_s"] <= c["first_s"] and c["last_s"] < p["last_s"])
        rows.append((max(0, counted(p) - reaped), counted(p), p))
    return rows


def summarize(record: dict, least_mib: float) -> str:
    """The processes that read at least LEAST_MIB themselves, most first: MiB read, when first and last seen."""
    rows = [row for row in own_reads(record["processes"]) if row[0] >= least_mib * MiB]
    lines = [f"{len(rows)} processes read at least {least_mib:g} MiB (of {len(record['processes'])} seen)",
             "| own MiB | counted MiB | first seen (s) | last seen (s) | pid | parent | command |",
             "| --- | --- | --- | --- | --- | --- | --- |"]
    for own, total, p in sorted(rows, key=lambda row: -row[0]):
        lines.append(f"| {own / MiB:.1f} | {total / MiB:.1f} | {p['first_s']:.2f} | {p['last_s']:.2f} | {p['pid']} | "
                     f"{p.get('ppid', '')} | `{p['command'][:120]}` |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="sample_reads_by_process.py", description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, help="where to write the samples")
    parser.add_argument("--every", type=float, default=0.05, help="seconds between samples")
    parser.add_argument("--summarize", type=Path, help="print the processes that read most in this file, and exit")
    parser.add_argument("--least-mib", type=float, default=1.0, help="leave out processes that read less")
    parser.add_argument("command", nargs=argparse.REMAINDER, help="-- the command to run while sampling")
    args = parser.parse_args(argv)
    if args.summarize is not None:
        try:
            record = json.loads(args.summarize.read_text())
            print(summarize(record, args.least_mib))
        except (OSError, ValueError, KeyError, TypeError) as exc:
            print(f"sample_reads_by_process.py: cannot read {args.summarize}: {exc}", file=sys.stderr)
            return 2
        return 0
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command or args.out is None or args.every <= 0:
        print("sample_reads_by_process.py: give --out FILE, a positive --every and -- COMMAND", file=sys.stderr)
        return 2
    sampler = Sampler(args.every)
    sampler.start()
    try:
        status = subprocess.call(command)
    except OSError as exc:
        sampler.stop()
        print(f"sample_reads_by_process.py: cannot run {command[0]}: {exc}", file=sys.stderr)
        return 2
    record = {"command": command} | sampler.stop()
    args.out.write_text(json.dumps(record))
    return status


if __name__ == "__main__":
    sys.exit(main())
