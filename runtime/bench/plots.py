"""The figures: the cold-start breakdown (one bar per mode, stages on a shared time axis, like Medusa's
Fig. 8) and the trace (p99 TTFT against request rate and against throughput, like Figs. 10 and 11, the
TTFT distribution, and the inter-token latency against request rate). matplotlib is imported here only, when a
figure is drawn."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from runtime.bench.records import ModeResult, StartRun
from runtime.timeline import STAGE_ORDER


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt

    return plt


def _save(fig, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.stem}.tmp-{os.getpid()}{path.suffix}")
    fig.savefig(tmp, dpi=150, bbox_inches="tight")
    tmp.replace(path)


def median_run(runs: list[StartRun]) -> StartRun:
    ordered = sorted(runs, key=lambda r: r.spawn_to_first_token_s)
    return ordered[(len(ordered) - 1) // 2]


def assign_lanes(stages: list[dict[str, Any]]) -> list[int]:
    """Lane per stage so that stages overlapping in time (weights streaming under graph restore) sit on
    separate lanes of the same bar instead of hiding each other."""
    lane_ends: list[float] = []
    lanes = [0] * len(stages)
    for i in sorted(range(len(stages)), key=lambda i: stages[i]["start_s"]):
        start, end = stages[i]["start_s"], stages[i]["end_s"]
        lane = next((n for n, last in enumerate(lane_ends) if last <= start + 1e-6), len(lane_ends))
        if lane == len(lane_ends):
            lane_ends.append(end)
        lane_ends[lane] = end
        lanes[i] = lane
    return lanes


def coldstart_title(context: dict[str, Any]) -> str:
    """A coldstart figure's title, from its JSON's context (model, machine, page_cache)."""
    machine = context["machine"]
    return (f"cold start of {context['model']} on {', '.join(machine['gpus']) or 'CPU'} "
            f"(page cache {context['page_cache']}, {machine['date_utc'][:10]})")


def trace_title(context: dict[str, Any]) -> str:
    """A trace figure's title, from its JSON's context (model, machine, the requests of each rate)."""
    machine = context["machine"]
    per_rate = (f"{context['requests_per_rate']} requests" if context.get("requests_per_rate")
                else f"{context['duration_s']:g} s")
    return (f"{context['model']} on {', '.join(machine['gpus']) or 'CPU'}, {per_rate} per rate "
            f"({machine['date_utc'][:10]})")


def switch_title(context: dict[str, Any]) -> str:
    """A switch figure's title, from its JSON's context (models, machine)."""
    return f"{len(context['models'])} models in one instance on {', '.join(context['machine']['gpus']) or 'CPU'}"


def plot_coldstart(results: list[ModeResult], path: Path, title: str) -> None:
    plt = _pyplot()
    colors = {name: plt.get_cmap("tab20")(i % 20) for i, name in enumerate(STAGE_ORDER)}
    fig, ax = plt.subplots(figsize=(11, 1.0 + 0.9 * len(results)))
    labelled: set[str] = set()
    for row, result in enumerate(reversed(results)):
        if not result.runs:
            ax.text(0.0, row, f"  {result.status}: {(result.reason or '')[:110]}", va="center", fontsize=8,
                    color="0.35")
            continue
        run = median_run(result.runs)
        # underneath, the whole spawn -> first token span: time that no stage accounts for shows grey
        ax.barh(row, run.spawn_to_first_token_s, height=0.8, color="0.9",
                label=None if "(no stage)" in labelled else "(no stage)")
        labelled.add("(no stage)")
        stages = [s for s in run.stages if s.get("end_s") is not None]
        lanes = assign_lanes(stages)
        height = 0.8 / (max(lanes, default=0) + 1)
        for stage, lane in zip(stages, lanes):
            name = stage["stage"]
            color = colors.get(name, "0.6")
            ax.barh(row - 0.4 + height * (lane + 0.5), stage["end_s"] - stage["start_s"], height=height,
                    left=stage["start_s"], color=color, edgecolor="white", linewidth=0.5,
                    label=None if name in labelled else name)
            labelled.add(name)
        ax.plot([run.spawn_to_first_token_s] * 2, [row - 0.45, row + 0.45], color="black", linewidth=1.5)
        ax.text(run.spawn_to_first_token_s, row, f" {run.spawn_to_first_token_s:.2f} s", va="center", fontsize=8)
    ax.set_yticks(range(len(results)), [r.mode for r in reversed(results)])
    ax.set_xlabel("seconds since spawn (median run; black line: first token at the client)")
    ax.set_title(title, fontsize=10)
    ax.set_xlim(left=0)
    ax.set_ylim(-0.6, len(results) - 0.4)
    handles, labels = ax.get_legend_handles_labels()
    order = sorted(range(len(labels)), key=lambda i: _stage_rank(labels[i]))
    ax.legend([handles[i] for i in order], [labels[i] for i in order], fontsize=7, loc="upper left",
              bbox_to_anchor=(1.0, 1.0))
    _save(fig, path)
    plt.close(fig)


def _stage_rank(name: str) -> int:
    return STAGE_ORDER.index(name) if name in STAGE_ORDER else len(STAGE_ORDER)


def plot_trace(points: list[dict[str, Any]], path: Path, title: str) -> None:
    """`points`: one per (mode, rate) that ran, with rate, throughput_rps, ttft_p99_s, ttfts_s and the ITL's
    itl_p50_s and itl_p99_s."""
    plt = _pyplot()
    fig, (by_rate, by_throughput, cdf, itl) = plt.subplots(1, 4, figsize=(20, 4))
    modes = list(dict.fromkeys(p["mode"] for p in points))
    styles = ["-", "--", ":", "-."]
    for i, mode in enumerate(modes):
        mine = sorted((p for p in points if p["mode"] == mode), key=lambda p: p["rate"])
        color = plt.get_cmap("tab10")(i)
        by_rate.plot([p["rate"] for p in mine], [p["ttft_p99_s"] for p in mine], "o-", color=color, label=mode)
        by_throughput.plot([p["throughput_rps"] for p in mine], [p["ttft_p99_s"] for p in mine], "o-",
                           color=color, label=mode)
        timed = [p for p in mine if p.get("itl_p50_s") is not None]
        for key, style, label in (("itl_p50_s", "o--", "p50"), ("itl_p99_s", "o-", "p99")):
            itl.plot([p["rate"] for p in timed], [p[key] * 1000 for p in timed], style, color=color,
                     label=f"{mode} {label}")
        for j, p in enumerate(mine):
            ttfts = sorted(p["ttfts_s"])
            cdf.plot(ttfts, [(k + 1) / len(ttfts) for k in range(len(ttfts))], styles[j % len(styles)],
                     color=color, label=f"{mode} @ {p['rate']:g}/s", drawstyle="steps-post")
    by_rate.set(xlabel="request rate (requests/s)", ylabel="p99 TTFT (s)", title="p99 TTFT vs rate")
    by_throughput.set(xlabel="throughput (requests/s)", ylabel="p99 TTFT (s)", title="p99 TTFT vs throughput")
    cdf.set(xlabel="TTFT (s)", ylabel="share of requests", title="TTFT distribution")
    itl.set(xlabel="request rate (requests/s)", ylabel="inter-token latency (ms)", title="ITL p50 (dashed), p99")
    for ax in (by_rate, by_throughput, cdf, itl):
        ax.set_ylim(bottom=0)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle(title, fontsize=10)
    _save(fig, path)
    plt.close(fig)


def plot_switch(probes: list[dict[str, Any]], fresh_s: dict[str, float | None], points: list[dict[str, Any]],
                path: Path, title: str) -> None:
    """Left: B's first token after a switch, per probe, beside a fresh instance of B and transformers.
    Right: the multi-model trace's TTFT distribution per system."""
    plt = _pyplot()
    fig, (bars, cdf) = plt.subplots(1, 2, figsize=(14, 4.5))
    labels, values, colors = [], [], []
    for p in probes:
        if p["status"] == "ok":
            labels.append(f"{p['model']}\n{p['state']} ({p['retained_fraction']:.0%})")
            values.append(p["ttft_s"])
            colors.append("tab:blue")
    for key, seconds in fresh_s.items():
        if seconds is not None:
            labels.append(key.replace(":", "\n"))
            values.append(seconds)
            colors.append("tab:gray")
    bars.bar(range(len(values)), values, color=colors)
    bars.set_xticks(range(len(values)), labels, fontsize=6, rotation=45, ha="right")
    bars.set_yscale("log")
    bars.set(ylabel="to B's first token (s, log)", title="switch (blue) vs a fresh start (gray)")
    bars.grid(alpha=0.3, axis="y")
    for i, p in enumerate(points):
        ttfts = sorted(p["ttfts_s"])
        cdf.plot(ttfts, [(k + 1) / len(ttfts) for k in range(len(ttfts))], color=plt.get_cmap("tab10")(i % 10),
                 label=f"{p['system']} @ {p['rate']:g}/s", drawstyle="steps-post")
    cdf.set_xscale("log")
    cdf.set(xlabel="TTFT (s, log)", ylabel="share of requests", title="multi-model trace")
    cdf.grid(alpha=0.3)
    if points:
        cdf.legend(fontsize=7)
    fig.suptitle(title, fontsize=10)
    _save(fig, path)
    plt.close(fig)


def plot_disk_queue(samples: list[list[float]], path: Path, window_s: float = 0.25) -> None:
    """scripts/sample_disk_queue.py's samples: the rate read and the requests in flight over time, in windows of
    WINDOW_S."""
    t, rate, in_flight, start = [], [], [], samples[0]
    for x in samples[1:]:
        if x[0] - start[0] >= window_s:
            t.append(start[0])
            rate.append((x[2] - start[2]) / 2**30 / (x[0] - start[0]))
            in_flight.append(x[3])
            start = x
    plt = _pyplot()
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(10, 5), sharex=True)
    top.plot(t, rate, drawstyle="steps-post")
    top.set_ylabel("read (GiB/s)")
    bottom.plot(t, in_flight, drawstyle="steps-post", color="tab:orange")
    bottom.set_ylabel("requests in flight")
    bottom.set_xlabel("seconds since the command began")
    _save(fig, path)
    plt.close(fig)
