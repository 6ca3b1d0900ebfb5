"""faas-bench switch on CPU: tiny random models of a real config in one instance, run as a user runs it (a
child process, real servers). Structure and what each number must satisfy are asserted, never speed."""

from __future__ import annotations

import asyncio
import json
from collections import Counter
from pathlib import Path

import pytest

from runtime.bench.multi_trace import zipf_models
from runtime.bench.switch import InstanceProbe, classify, in_instance, probe_targets
from runtime.bench.switch_first import boot_order
from runtime.bench.switch_models import BenchModel, layout_bytes, parse_shapes
from runtime.bench.switch_partial import (PartialUnreachable, filler, measure_partial, partial_budget, probe_partial,
                                          size_partial)
from tests.pool.helpers import make_layout
from tests.server.test_multi_model import served_text
from tests.test_bench import PNG_MAGIC, faas_bench


def model(name: str, shape: str, nbytes: int) -> BenchModel:
    return BenchModel(name, shape, 0, Path("/hf"), Path("/layout"), nbytes)


def test_shapes_zipf_and_targets():
    assert parse_shapes("qwen2-1.5b:4,llama-3-8b") == [("qwen2-1.5b", 4), ("llama-3-8b", 1)]
    with pytest.raises(ValueError, match="unknown shape 'gpt-5'"):
        parse_shapes("gpt-5:2")
    models = [model("q0", "q", 3), model("q1", "q", 3), model("l0", "l", 16), model("l1", "l", 16)]
    picks = Counter(m.name for m in zipf_models(models, 4000, 1.0, seed=0))
    assert picks["q0"] > picks["q1"] > picks["l0"] > picks["l1"] > 0  # weights 1, 1/2, 1/3, 1/4
    assert abs(picks["q0"] / picks["q1"] - 2) < 0.3
    assert zipf_models(models, 50, 1.0, seed=3) == zipf_models(models, 50, 1.0, seed=3)
    targets = [(b.name, a.name, [o.name for o in others]) for b, a, others in probe_targets(models)]
    assert targets == [("q0", "q1", ["l0", "l1"]), ("l0", "q0", ["l1", "q1"])]
    # an instance starts its first model at boot: a model that is no B, so each B's first request starts it
    assert [m.name for m in boot_order(models, probe_targets(models))] == ["q1", "l1", "q0", "l0"]
    assert [classify(f) for f in (1.0, 0.5, 0.0)] == ["retained", "partial", "evicted"]
    # the partial state's filler: the smallest model at least as large as B, else the largest
    assert [filler(b, models).name for b in models] == ["q1", "q0", "l1", "l0"]
    assert filler(models[2], models[:3]).name == "q0"  # none as large as l0: the largest other, first of equals


PROMPT = [3, 17, 42, 99, 5, 250, 7]


def test_partial_probe_leaves_part_of_b_which_then_answers_as_alone(tiny_model, tmp_path):
    """The bench's own sizing and budget, on two tiny models whose layouts have small chunks (several
    groups each): B partly retained when its request arrives, its output exactly transformers' greedy one,
    and /health's account of that switch."""
    b, f = [BenchModel(preset, preset, 0, Path(tiny_model(preset)), layout, layout_bytes(layout))
            for preset in ("tiny-llama", "tiny-qwen2")
            for layout in [make_layout(tiny_model(preset), tmp_path / preset)]]
    settings = {"DEVICE": "cpu", "MAX_MODEL_LEN": "256", "MAX_NUM_SEQS": "4"}

    async def probe():
        partial, budget = await size_partial(settings, "cpu", b, f, PROMPT, tmp_path / "logs", 120)

        async def work(instance):  # the bench's probe, its requests asking for ten tokens
            ten = InstanceProbe(instance.client, instance.url, PROMPT, 120, max_tokens=10)
            row = await measure_partial(ten, b, f)
            return row, ten.outputs[b.name], await ten.health()

        return budget, await in_instance("cold", partial, PROMPT, tmp_path / "logs" / "partial.log", 120, work)

    budget, (row, text, health) = asyncio.run(probe())
    pool = health["pools"]["cpu"]
    assert abs(pool["budget_bytes"] - budget) <= 1
    assert row.status == "ok" and row.previous == f.name and 0 < row.retained_fraction < 1, row
    assert text == served_text(str(b.hf_dir), PROMPT, 10)
    m = pool["models"][b.name]
    assert m["resident_bytes"] == m["total_bytes"] and m["loads"] == 2  # its start, then the partial reload
    assert abs(row.bytes_loaded / m["total_bytes"] - (1 - row.retained_fraction)) < 1e-4  # what was missing
    parts = [m[f"last_switch_{part}_s"] for part in ("evict", "map", "stream")]
    assert min(parts) >= 0 and parts[2] > 0 and sum(parts) <= m["last_switch_s"]
    assert [row.switch_s, row.evict_s, row.map_s, row.stream_s] == [round(v, 6) for v in [m["last_switch_s"], *parts]]
    assert row.ttft_s > 0 and row.active_ttft_s > 0
    (switch,) = [s for s in health["stages"] if s["stage"] == "model_switch"]  # the latest switch: B's
    assert switch["detail"]["model"] == b.name and switch["detail"]["bytes"] == row.bytes_loaded
    assert [switch["detail"][f"{part}_s"] for part in ("evict", "map", "stream")] == [round(v, 6) for v in parts]


def test_bad_shapes_stop_the_bench_with_one_line(tmp_path):
    done = faas_bench("switch", "--shapes", "gpt-5:2", "--out", str(tmp_path), timeout=60)
    assert done.returncode == 2 and "unknown shape 'gpt-5'" in done.stderr
    done = faas_bench("switch", "--first-kernels", "beside,during", "--out", str(tmp_path), timeout=60)
    assert done.returncode == 2 and "kernels must be among beside,after,restored" in done.stderr
    assert not any(tmp_path.iterdir())  # stopped before anything was made


def test_switch_smoke_on_cpu(tmp_path):
    out = tmp_path / "out"
    done = faas_bench("switch", "--device", "cpu", "--shapes", "tiny:3", "--models-dir", str(tmp_path / "models"),
                      "--chunk-mb", "1", "--rates", "4", "--duration", "2", "--length-scale", "0.02", "--max-len",
                      "128", "--idle-timeout", "2", "--timeout", "180", "--gpus", "2", "--fresh-modes", "process,cold",
                      "--out", str(out),
                      timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    latency = json.loads((out / "switch-latency.json").read_text())
    assert [m["name"] for m in latency["models"]] == ["tiny-0", "tiny-1", "tiny-2"]
    assert len({m["seed"] for m in latency["models"]}) == 3
    probes = latency["probes"]
    assert [p["state"] for p in probes] == ["retained", "partial", "evicted"]
    measured = [p for p in probes if p["status"] == "ok"]
    assert measured and all(p["reason"] for p in probes if p["status"] == "skipped")
    for p in measured:
        assert p["model"] == "tiny-0" and p["previous"] == "tiny-1" and p["ttft_s"] > 0
        assert (p["retained_fraction"] == 1.0) == (p["state"] == "retained")
        assert (p["bytes_loaded"] > 0) == (p["state"] != "retained")
        parts = [p["evict_s"], p["map_s"], p["stream_s"]]  # where the pool's activation of B went
        if p["bytes_loaded"]:
            assert min(parts) >= 0 and p["stream_s"] > 0 and sum(parts) <= p["switch_s"], p
        else:
            assert parts == [None] * 3 and p["switch_s"] is None
    partial = probes[1]  # in an instance of its own, whose budget leaves part of B when its filler is served
    assert partial["status"] == "ok" and 0 < partial["retained_fraction"] < 1, partial
    assert 0 < partial["bytes_loaded"] < latency["models"][0]["nbytes"]
    evicted = probes[2]  # reached by the cost model, or else by whole-model eviction in a second instance
    assert evicted["status"] == "ok" and evicted["retained_fraction"] == 0.0, evicted
    assert evicted["bytes_loaded"] == latency["models"][0]["nbytes"] and evicted["eviction"] in ("cost", "lru")
    firsts = {f["kernels"]: f for f in latency["first_activations"]}  # B's first request, A active, per kind
    assert list(firsts) == ["beside", "after", "restored"]
    for f in (firsts["beside"], firsts["after"]):  # B's engine started by that request: its weights streamed
        assert f["status"] == "ok" and f["model"] == "tiny-0" and f["previous"] == "tiny-1", f
        assert f["ttft_s"] >= f["total_s"] >= f["stream_s"] > 0 and f["active_ttft_s"] > 0
        assert f["graphs_restored"] is False and f["kernels_loaded"] >= 0
    restored = firsts["restored"]
    assert restored["status"] == "skipped" and "need a GPU" in restored["reason"] and restored["ttft_s"] is None
    fresh = latency["fresh"]  # B's fresh instance from the process snapshot faas-build baked for it, and cold
    assert [fresh[f"tiny-0:{mode}"]["status"] for mode in ("process", "cold", "transformers")] == ["ok"] * 3
    trace = json.loads((out / "multi-model-trace.json").read_text())
    points = {p["system"]: p for p in trace["points"]}
    assert list(points) == ["pool", "lru", "pool-affinity", "pool-round-robin", "pool-fixed", "per-model"]
    for p in points.values():
        assert p["status"] == "ok" and p["completed"] == p["requests"] > 0, (p["system"], p["errors"])
        assert p["ttft_p50_s"] <= p["ttft_p99_s"] and p["bytes_streamed"] > 0
    assert list(points["pool"]["devices"]) == ["cpu"]
    for system in ("pool-affinity", "pool-round-robin", "pool-fixed"):  # two simulated devices, half the memory each
        devices = points[system]["devices"]
        assert sorted(devices) == ["cpu:0", "cpu:1"]
        assert sum(d["bytes_streamed"] for d in devices.values()) == points[system]["bytes_streamed"]
        assert all(0 < d["pool_used_peak_bytes"] <= trace["pool_bytes"] // 2 for d in devices.values())
    assert all(d["bytes_streamed"] > 0 for d in points["pool-fixed"]["devices"].values())  # each holds its models
    assert points["per-model"]["switches"] >= 1  # instance starts
    assert (out / "switch.png").read_bytes().startswith(PNG_MAGIC)
    table = (out / "switch.md").read_text()
    assert "| tiny-0 | beside |" in table and "| tiny-0 | restored | skipped: materialized snapshots need" in table
    assert "| B | state | retained | B's first token (s) | B active (s) | switch (s) | evict (s) | map (s) | " \
        "stream (s) |" in table and "| tiny-0 | partial |" in table
    assert "| pool | 4 |" in table and "| per-model | 4 |" in table
    assert "| pool-fixed | 4 | cpu:1 |" in table
    assert "trace pool at 4/s:" in done.stderr  # progress


def test_a_b_of_one_group_cannot_be_partly_retained_and_the_row_says_so(tiny_model, tmp_path):
    """B served from its Hugging Face directory is one group: what F's activation evicts of it is all of it."""
    hf = Path(tiny_model("tiny-llama"))
    b = BenchModel("whole", "tiny-llama", 0, hf, hf, sum(f.stat().st_size for f in hf.glob("*.safetensors")))
    layout = make_layout(tiny_model("tiny-qwen2"), tmp_path / "f")
    f = BenchModel("f", "tiny-qwen2", 1, layout, layout, layout_bytes(layout))
    row = asyncio.run(probe_partial({"DEVICE": "cpu", "MAX_MODEL_LEN": "256", "MAX_NUM_SEQS": "4"}, "cpu", b, f,
                                    PROMPT, tmp_path / "logs", 120))
    assert (row.state, row.status, row.retained_fraction, row.ttft_s) == ("partial", "skipped", 0.0, None)
    assert row.reason.startswith("whole was evicted (0% retained) after f was made resident") and \
        "whole groups" in row.reason


def test_the_partial_budget_needs_both_models_whole_in_the_sizing_pool():
    models = {"b": {"resident_bytes": 100, "total_bytes": 100, "kv_bytes": 10},
              "f": {"resident_bytes": 60, "total_bytes": 60, "kv_bytes": 5}}
    pool = {"budget_bytes": 1000, "free_bytes": 700, "models": models}
    assert partial_budget(pool, "b", "f") == 300 - 10 - 30  # less B's KV cache, less half the smaller model
    models["f"]["resident_bytes"] = 30
    with pytest.raises(PartialUnreachable, match="did not keep all of f"):
        partial_budget(pool, "b", "f")
