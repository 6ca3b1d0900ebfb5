"""How fast the entry point's read-ahead fills a dropped page cache while its own process runs Python: the
start pages of a snapshot (if given) and then a layout's weights, read by runtime/read_ahead.py's ReadAhead
exactly as the entry point starts them (8 threads for the pages, then 16 for the weights), alone or beside a
thread that runs Python without pause, as the bootstrap's imports and checks do while the readers read.

A reader thread takes the GIL back after every read call; a thread that runs Python gives it up only when
asked, after the interpreter's switch interval (5 ms unless set). So the probe varies the switch interval (ms; 5
unless given), set for the read and set back after it. The page cache is dropped before each
read; the ways alternate for --rounds rounds. Needs root (drop_caches).

    python scripts/probe_read_ahead_beside_python.py /tmp/thawllm-models/llama-3-8b-baked/layout \\
        --start-pages /tmp/thawllm-models/llama-3-8b-baked/snapshots/process/start-pages.json \\
        --ways alone,busy,busy:si=0.5 --out read-ahead-beside-python-h200-llama-3-8b.json

A way is `alone` or `busy`, then optionally `:si=MS`. Exit 2 with one line on bad input.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import threading
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from runtime import read_ahead  # noqa: E402
from runtime.bench.page_cache import turns_from_dropped  # noqa: E402
from runtime.weights import prefetch  # noqa: E402
from snapshots import start_pages  # noqa: E402

GiB = 1 << 30
#: CPython's own switch interval
INTERPRETER_SWITCH_INTERVAL_S = 0.005


@dataclass(frozen=True)
class Way:
    text: str
    busy: bool
    switch_interval_s: float


def parse_way(text: str, default_si: float) -> Way:
    head, *options = text.strip().split(":")
    if head not in ("alone", "busy"):
        raise ValueError(f"{text!r}: a way starts with alone or busy")
    si = default_si
    for option in options:
        key, _, value = option.partition("=")
        try:
            if key != "si" or float(value) <= 0:
                raise ValueError
        except ValueError:
            raise ValueError(f"{text!r}: {option!r} is not si=MS (above 0)") from None
        si = float(value) / 1000
    return Way(text.strip(), head == "busy", si)


def run_python(stop: threading.Event) -> None:
    """Python without pause until STOP: it lets the GIL go only when the interpreter asks it to."""
    total = 0
    while not stop.is_set():
        for i in range(10_000):
            total += i * i


def read_once(pages: list[read_ahead.Piece], weights: list[read_ahead.Piece], way: Way) -> dict[str, float]:
    """Seconds from the start to the start pages (0 without them) and to the weights in the page cache."""
    interval = sys.getswitchinterval()
    sys.setswitchinterval(way.switch_interval_s)
    stop = threading.Event()
    busy = threading.Thread(target=run_python, args=(stop,), daemon=True) if way.busy else None
    try:
        if busy is not None:
            busy.start()
        first = (read_ahead.ReadAhead("start pages", pages, start_pages.READERS, exact=True) if pages else None)
        second = read_ahead.ReadAhead("weights prefetch", weights, prefetch.READERS, first)
        second.join()
        started = first.started if first is not None else second.started
        return {"start_pages_s": round(first.ended - started, 4) if first is not None else 0.0,
                "weights_s": round(second.ended - started, 4)}
    finally:
        stop.set()
        if busy is not None:
            busy.join()
        sys.setswitchinterval(interval)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("layout", type=Path, help="a faas-build layout directory")
    parser.add_argument("--start-pages", type=Path, help="a snapshot's start-pages.json, read first")
    parser.add_argument("--ways", default="alone,busy", help="comma-separated alone|busy[:si=MS]")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args(argv)
    files = prefetch.layout_files(str(args.layout))
    if not files:
        print(f"probe_read_ahead_beside_python: {args.layout} is not a faas-build layout", file=sys.stderr)
        return 2
    try:
        ways = [parse_way(text, INTERPRETER_SWITCH_INTERVAL_S) for text in args.ways.split(",")]
        pages = start_pages.pieces(start_pages.read_list(args.start_pages)) if args.start_pages else []
    except (OSError, ValueError) as exc:
        print(f"probe_read_ahead_beside_python: {exc}", file=sys.stderr)
        return 2
    weights = prefetch.pieces(files)
    results: dict[str, list[dict[str, float]]] = {way.text: [] for way in ways}
    try:
        for round_, way in turns_from_dropped(ways, args.rounds):
            results[way.text].append(read_once(pages, weights, way))
            print(f"round {round_}: {way.text} {results[way.text][-1]}", flush=True)
    except PermissionError as exc:
        print(f"probe_read_ahead_beside_python: {exc}", file=sys.stderr)
        return 2
    total = sum(length for _, _, length in weights)
    median = {name: {key: statistics.median(r[key] for r in runs) for key in runs[0]} for name, runs in results.items()}
    report = {"layout": str(args.layout), "start_pages": str(args.start_pages) if args.start_pages else None,
              "start_pages_bytes": sum(length for _, _, length in pages), "weights_bytes": total,
              "rounds": args.rounds, "runs": results, "median": median}
    for name, m in median.items():
        print(f"{name}: start pages {m['start_pages_s']:.2f} s, weights in the page cache {m['weights_s']:.2f} s "
              f"after the start ({total / GiB / (m['weights_s'] - m['start_pages_s']):.2f} GiB/s after the pages)")
    if args.out:
        args.out.write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
