"""Where each start of a `faas-bench coldstart` run spent its way to the first token, from its boot log beside
the run's JSON: the start pages' read, the weights' prefetch (when it was widened to all its threads, when its
last read ended, and how much later than the round's reference read of the weights took), when the restore
handed over, how much of the weights was in the page cache when the bootstrap chose who streams them, when the
helper began its stream, and how long after the prefetch's last read the runtime was ready and the first token
came (negative: before it). Times are seconds since spawn unless a column says otherwise.

    python scripts/coldstart_log_timeline.py docs/benchmarks/coldstart-h200-llama-3-8b-dropped.json

The logs are read from the JSON's folder's `logs/` (as faas-bench writes them), else from `<name>-logs/` beside
it (as docs/benchmarks/ keeps them), else from --logs. Prints a markdown table, a row per start, and each mode's
medians. A line the log lacks (a warm start reads nothing ahead) is an empty cell. Exit 2 with one line on bad
input.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
from dataclasses import dataclass, fields
from datetime import datetime
from pathlib import Path

#: the log lines each column is read from (the log's own wording: runtime/read_ahead.py, runtime/weights/prefetch.py,
#: snapshots/process.py, runtime/server)
START_PAGES = re.compile(r"start pages: [0-9.]+ GiB in the page cache ([0-9.]+) s after it began")
PREFETCH_END = re.compile(r"^(\S+) .*weights prefetch: [0-9.]+ GiB in the page cache", re.M)
WIDENED = re.compile(r"weights prefetch: \d+ threads from ([0-9.]+) s after it began")
CACHED_AT_CHOICE = re.compile(r"process snapshot: (\d+)% of the weights in the page cache")
READY_LINE = re.compile(r"^(\S+) .*ready: serving", re.M)


@dataclass
class StartTimes:
    mode: str
    run: int
    spawn_to_first_token: float
    start_pages_s: float | None = None
    widened_after_s: float | None = None
    restore_end: float | None = None
    cached_at_choice_pct: int | None = None
    helper_stream_start: float | None = None
    prefetch_end: float | None = None
    prefetch_over_reference_s: float | None = None  # what the prefetch took beyond the round's reference read
    ready: float | None = None
    ready_after_prefetch_s: float | None = None
    # the first token against the prefetch's last read, whose time the disk decides: what a start's own order of
    # work gains or loses, with the disk's spread from round to round taken out
    answer_after_prefetch_s: float | None = None


def read_start(mode: str, run: int, record: dict, log: str) -> StartTimes:
    stages = {s["stage"]: s for s in record["stages"]}
    times = StartTimes(mode, run, record["spawn_to_first_token_s"])
    if "ready" in stages:
        times.ready = stages["ready"]["start_s"]
    if "restore" in stages:
        times.restore_end = stages["restore"]["end_s"]
    weights = stages.get("weights", {})
    if weights.get("detail", {}).get("during_restore"):
        times.helper_stream_start = weights["start_s"]
    if m := START_PAGES.search(log):
        times.start_pages_s = float(m.group(1))
    if m := WIDENED.search(log):
        times.widened_after_s = float(m.group(1))
    if m := CACHED_AT_CHOICE.search(log):
        times.cached_at_choice_pct = int(m.group(1))
    prefetched, ready = PREFETCH_END.search(log), READY_LINE.search(log)
    if prefetched and ready and times.ready is not None:
        # the log's clock is the wall's, the timeline's is seconds since spawn: the ready line ties the two
        after = (_clock(ready.group(1)) - _clock(prefetched.group(1))).total_seconds()
        times.ready_after_prefetch_s = round(after, 3)
        times.prefetch_end = round(times.ready - after, 3)
        times.answer_after_prefetch_s = round(times.spawn_to_first_token - times.prefetch_end, 3)
        if record.get("reference_read_s"):
            times.prefetch_over_reference_s = round(times.prefetch_end - record["reference_read_s"], 3)
    return times


def _clock(text: str) -> datetime:
    return datetime.strptime(text, "%H:%M:%S.%f")


def read_run(report: dict, logs: Path) -> list[StartTimes]:
    starts = []
    for mode, result in report["modes"].items():
        for i, record in enumerate(result.get("runs", []), 1):
            log = logs / f"{mode}-{i}.log"
            starts.append(read_start(mode, i, record, log.read_text() if log.is_file() else ""))
    return starts


def logs_beside(run_json: Path) -> Path:
    for candidate in (run_json.parent / "logs", run_json.with_name(run_json.stem + "-logs")):
        if candidate.is_dir():
            return candidate
    raise FileNotFoundError(f"no logs/ or {run_json.stem}-logs/ beside {run_json} (give --logs)")


def table(starts: list[StartTimes]) -> str:
    columns = [f.name for f in fields(StartTimes)]
    lines = ["| " + " | ".join(columns) + " |", "|" + " --- |" * len(columns)]
    for start in starts:
        lines.append("| " + " | ".join(_cell(getattr(start, c)) for c in columns) + " |")
    return "\n".join(lines)


def medians(starts: list[StartTimes]) -> str:
    numbers = [f.name for f in fields(StartTimes)][2:]
    lines = []
    for mode in dict.fromkeys(s.mode for s in starts):
        mine = [s for s in starts if s.mode == mode]
        parts = []
        for name in numbers:
            values = [getattr(s, name) for s in mine if getattr(s, name) is not None]
            if values:
                parts.append(f"{name} {statistics.median(values):.3f}")
        lines.append(f"{mode} (median of {len(mine)}): " + ", ".join(parts))
    return "\n".join(lines)


def _cell(value: object) -> str:
    return "" if value is None else f"{value:.3f}" if isinstance(value, float) else str(value)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("run", type=Path, help="a faas-bench coldstart JSON")
    parser.add_argument("--logs", type=Path, help="the folder of its boot logs (MODE-N.log)")
    args = parser.parse_args(argv)
    try:
        report = json.loads(args.run.read_text())
        logs = args.logs or logs_beside(args.run)
        if not logs.is_dir():
            raise FileNotFoundError(f"{logs} is not a folder")
        starts = read_run(report, logs)
    except (OSError, ValueError, KeyError, TypeError) as exc:
        print(f"coldstart_log_timeline: {exc}", file=sys.stderr)
        return 2
    if not starts:
        print(f"coldstart_log_timeline: {args.run} holds no start", file=sys.stderr)
        return 2
    print(table(starts))
    print()
    print(medians(starts))
    return 0


if __name__ == "__main__":
    sys.exit(main())
