"""One report from several `faas-bench trace` runs of the same workload, each of some of the modes (a run per
mode or two, where all of them would not fit one machine's time limit): trace.json, trace.md and trace.png
as one run writes them, the table headed by each part's command, machine and date.

    python scripts/merge_trace.py results/trace-a/trace.json results/trace-b/trace.json --out results/trace

The parts must share the model, the settings, the workload (seed, lengths, requests or duration per rate),
the scaling policy and the GPUs' model (each part's line names its driver), but not where their snapshots
were (SNAPSHOT_DIR, --instance-snapshot-dirs, --pid-namespaces); a (mode, rate) may appear in one part only.
The table lists the modes in the bench's order (gpu, process, materialized, cold), each by rate.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from runtime.bench.records import SERVER_MODES  # noqa: E402
from runtime.bench.report import provenance  # noqa: E402
from runtime.bench.trace_command import points_from_json, write_trace_files  # noqa: E402

#: what makes two runs' points comparable (the context keys that must be equal)
SAME = ("model", "settings", "seed", "prompt_mean", "output_mean", "max_len", "duration_s", "requests_per_rate",
        "exact_prompt_lengths", "policy")
#: where each part's instances found their snapshots may differ (each part's command says so)
PLACEMENT = {"settings": ("SNAPSHOT_DIR",), "policy": ("snapshot_dirs", "own_pid_namespaces")}


class MergeError(Exception):
    """Parts that cannot make one report: one line, exit 2."""


def load(path: Path) -> dict:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise MergeError(f"{path}: {exc}") from None
    if not isinstance(data, dict) or data.get("command") != "trace":
        raise MergeError(f"{path}: not a faas-bench trace JSON")
    if "parts" in data:
        first = data["parts"][0]["file"]
        raise MergeError(f"{path} is a merged report: give the runs' own trace.json files ({first}, ...)")
    return data


def merge(parts: list[tuple[Path, dict]]) -> tuple[dict, list]:
    """The merged context (the first part's, its command and machine with every other part's under `parts`)
    and the points."""
    (first_path, first), points, seen = parts[0], [], {}
    for index, (path, data) in enumerate(parts):
        for key in SAME:
            mine, theirs = _comparable(key, data.get(key)), _comparable(key, first.get(key))
            if mine != theirs:
                raise MergeError(f"{path} and {first_path} differ in {key}: {mine!r} against {theirs!r}")
        if _gpu_models(data) != _gpu_models(first):  # the driver may differ: each part names its own
            raise MergeError(f"{path} ran on {_gpu_models(data) or 'no GPU'}, {first_path} on "
                             f"{_gpu_models(first) or 'no GPU'}")
        for point in points_from_json(data):
            where = seen.setdefault((point.mode, point.rate), index)
            if where != index:
                raise MergeError(f"{point.mode} at {point.rate:g} requests/s is in both {parts[where][0]} and {path}")
            points.append(point)
    context = {**first, "parts": [{"file": str(path), "argv": data["argv"], "machine": data["machine"]}
                                  for path, data in parts]}
    context.pop("points")
    context.pop("argv")  # each part's is under `parts`
    return context, sorted(points, key=lambda p: (SERVER_MODES.index(p.mode), p.rate))


def _comparable(key: str, value):
    if isinstance(value, dict) and key in PLACEMENT:
        return {k: v for k, v in value.items() if k not in PLACEMENT[key]}
    return value


def _gpu_models(data: dict) -> list[str]:
    """The GPUs' names without the driver's version ("NVIDIA H100 80GB HBM3, 580.159.04")."""
    return [gpu.split(",")[0].strip() for gpu in data.get("machine", {}).get("gpus", [])]


def main() -> int:
    parser = argparse.ArgumentParser(prog="merge_trace", description=__doc__.split("\n\n")[0])
    parser.add_argument("parts", nargs="+", type=Path, help="the runs' trace.json files, in the table's order")
    parser.add_argument("--out", type=Path, required=True, help="folder for the merged trace.json, .md and .png")
    args = parser.parse_args()
    try:
        if len(args.parts) < 2:
            raise MergeError("give two or more trace.json files")
        if any(p.resolve() == (args.out / "trace.json").resolve() for p in args.parts):
            raise MergeError(f"--out {args.out} holds one of the parts; choose another folder")
        context, points = merge([(path, load(path)) for path in args.parts])
    except MergeError as exc:
        print(f"merge_trace: {exc}", file=sys.stderr)
        return 2
    args.out.mkdir(parents=True, exist_ok=True)
    header = "\n".join(provenance({**context, **part}) for part in context["parts"])
    table, written = write_trace_files(args.out, context, points, header)
    print(f"{table}\n\nwrote {', '.join(map(str, written))}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
