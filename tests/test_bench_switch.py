"""faas-bench switch on CPU: tiny random models of a real config in one instance, run as a user runs it (a
child process, real servers). Structure and what each number must satisfy are asserted, never speed."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import pytest

from runtime.bench.multi_trace import zipf_models
from runtime.bench.switch import classify, probe_targets
from runtime.bench.switch_first import boot_order
from runtime.bench.switch_models import BenchModel, parse_shapes
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
                      "128", "--idle-timeout", "2", "--timeout", "180", "--gpus", "2", "--fresh-modes", "process,cold", "--out", str(out),
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
    assert "| B | state |" in table and "| pool | 4 |" in table and "| per-model | 4 |" in table
    assert "| pool-fixed | 4 | cpu:1 |" in table
    assert "trace pool at 4/s:" in done.stderr  # progress
