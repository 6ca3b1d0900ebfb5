"""Several models in one real server (MODEL=name=reference,...), through the real `openai` client: each model
answers exactly as transformers does with that model alone, whatever the interleaving, and when the pool
cannot hold them all, eviction and reload leave the outputs unchanged."""

from __future__ import annotations

import json
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import openai
import pytest

from tests.server.conftest import API_KEY, REPO, server_env, start_server
from tests.server.test_openai_api import metrics
from tests.test_engine import hf_greedy

MODELS = ("tiny-llama", "tiny-qwen2", "tiny-qwen3")
PROMPTS = [[3, 17, 42, 99, 5], [250, 7, 7, 1, 33, 120, 64], [11, 300]]
MAX_TOKENS = 10


def served_text(model_dir: str, prompt: list[int], n: int) -> str:
    """What a server makes of transformers' greedy tokens: the engine's own detokenizer over them."""
    from runtime.engine.detokenizer import OutputText
    from runtime.engine.tokenizer import Tokenizer

    tokens, _ = hf_greedy(model_dir, prompt, n)
    text = OutputText(Tokenizer(Path(model_dir)), prompt, [])
    for token in tokens:
        text.add_token(token)
    return text.text


@pytest.fixture(scope="module")
def model_dirs(tiny_model) -> dict[str, str]:
    return {name: tiny_model(name) for name in MODELS}


@pytest.fixture(scope="module")
def expected(model_dirs) -> dict[tuple[str, int], str]:
    return {(name, i): served_text(model_dirs[name], prompt, MAX_TOKENS)
            for name in MODELS for i, prompt in enumerate(PROMPTS)}


def model_list(model_dirs: dict[str, str]) -> str:
    return ",".join(f"{name}={path}" for name, path in model_dirs.items())


def start(tmp_path_factory, name: str, model_dirs: dict[str, str], **settings: str):
    srv = start_server(tmp_path_factory.mktemp(name), name, MODEL=model_list(model_dirs), API_KEY=API_KEY,
                       MAX_MODEL_LEN="256", MAX_NUM_SEQS="4", **settings)
    try:
        srv.wait_ready()
    except Exception:
        srv.stop()
        raise
    return srv


@pytest.fixture(scope="module")
def roomy(tmp_path_factory, model_dirs):
    """A pool that holds every model."""
    srv = start(tmp_path_factory, "roomy", model_dirs, POOL_MEMORY_GB="1")
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def tight(tmp_path_factory, model_dirs, roomy):
    """A pool that cannot hold the weights of all three models at once beside the active one's KV cache, even
    with the KV caches of the idle ones given back (half the smallest model short): switches evict weights."""
    for name in MODELS:
        complete(roomy, name, PROMPTS[0])
    pool = http_get(roomy, "/health")["pools"]["cpu"]
    all_three = pool["budget_bytes"] - pool["free_bytes"]  # weights, KV caches and buffers of all three
    models = pool["models"].values()
    kv = [m["kv_bytes"] for m in models]
    budget = all_three - sum(kv) + max(kv) - min(m["total_bytes"] for m in models) // 2
    srv = start(tmp_path_factory, "tight", model_dirs, POOL_MEMORY_GB=str(budget / 2**30))
    yield srv
    srv.stop()


def http_get(srv, path: str) -> dict:
    return httpx.get(f"{srv.url}{path}", headers={"Authorization": f"Bearer {API_KEY}"}, timeout=30).json()


def client(srv) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{srv.url}/v1", api_key=API_KEY, max_retries=0, timeout=120)


def complete(srv, model: str, prompt: list[int]) -> str:
    r = client(srv).completions.create(model=model, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0,
                                       extra_body={"ignore_eos": True})
    assert r.model == model
    return r.choices[0].text


def test_interleaved_requests_get_each_models_own_greedy_output(roomy, expected):
    jobs = [(name, i) for i in range(len(PROMPTS)) for name in MODELS] * 2
    with ThreadPoolExecutor(6) as pool:
        texts = list(pool.map(lambda job: complete(roomy, job[0], PROMPTS[job[1]]), jobs))
    assert texts == [expected[job] for job in jobs]


def test_models_lists_every_model(roomy):
    listed = client(roomy).models.list().data
    assert [m.id for m in listed] == list(MODELS)
    assert client(roomy).models.retrieve("tiny-qwen2").id == "tiny-qwen2"


def test_a_request_must_name_a_served_model(roomy):
    with pytest.raises(openai.NotFoundError) as info:
        client(roomy).completions.create(model="tiny-gpt", prompt="hi", max_tokens=2)
    assert info.value.code == "model_not_found" and "tiny-llama" in info.value.message
    r = httpx.post(f"{roomy.url}/v1/completions", json={"prompt": "hi", "max_tokens": 2},
                   headers={"Authorization": f"Bearer {API_KEY}"}, timeout=30)
    assert r.status_code == 400 and "'model' is required" in r.json()["error"]["message"]


def test_health_and_metrics_report_each_model(roomy):
    complete(roomy, "tiny-qwen3", PROMPTS[0])
    health = http_get(roomy, "/health")
    assert health["models"] == list(MODELS) and health["placement"] == "affinity"
    pool = health["pools"]["cpu"]
    qwen3 = pool["models"]["tiny-qwen3"]
    assert qwen3["resident_bytes"] == qwen3["total_bytes"] > 0 and qwen3["loads"] >= 1
    first = qwen3["first_start"]  # its engine's start: the weights streamed, no graphs on the host
    assert first["total_s"] >= first["stream_s"] > 0 and first["graphs_restored"] is False
    assert 0 < pool["free_bytes"] < pool["budget_bytes"]
    with httpx.Client(base_url=roomy.url, headers={"Authorization": f"Bearer {API_KEY}"}) as http:
        m = metrics(http)
    for name in MODELS:
        assert f"thawllm_model_bytes{{device=cpu,model={name}}}" in m
    assert m["thawllm_model_resident_bytes{device=cpu,model=tiny-qwen3}"] == qwen3["total_bytes"]
    assert m["thawllm_model_loads_total{device=cpu,model=tiny-qwen3}"] >= 1
    assert m["thawllm_model_switch_seconds_count{device=cpu,model=tiny-qwen3}"] >= 1
    assert m["thawllm_pool_free_bytes{device=cpu}"] == pytest.approx(pool["free_bytes"], rel=0.5)
    assert m["thawllm_time_to_first_token_seconds_count"] >= 1  # the instance-wide series stay
    assert "model_switch" in health["timeline"]


def test_a_pool_too_small_for_all_evicts_and_reloads_with_the_same_outputs(tight, expected):
    order = [("tiny-llama", 0), ("tiny-qwen2", 1), ("tiny-qwen3", 2), ("tiny-llama", 1), ("tiny-qwen2", 0),
             ("tiny-qwen3", 0), ("tiny-llama", 2)]
    assert [complete(tight, name, PROMPTS[i]) for name, i in order] == [expected[job] for job in order]
    models = http_get(tight, "/health")["pools"]["cpu"]["models"]
    assert sum(m["loads"] for m in models.values()) > len(MODELS)  # evicted by the others, then loaded again
    assert all(m["switches"] >= 2 for m in models.values())
    for m in models.values():  # where each model's last load went: room made, memory backed, weights streamed
        parts = [m[f"last_switch_{part}_s"] for part in ("evict", "map", "stream")]
        assert min(parts) >= 0 and m["last_switch_stream_s"] > 0 and sum(parts) <= m["last_switch_s"], m
    # requests for a model that is not resident, arriving together, wait for one switch
    missing = next(name for name, m in models.items() if m["resident_bytes"] < m["total_bytes"])
    with ThreadPoolExecutor(3) as pool:
        texts = list(pool.map(lambda i: complete(tight, missing, PROMPTS[i]), range(3)))
    assert texts == [expected[(missing, i)] for i in range(3)]
    assert http_get(tight, "/health")["pools"]["cpu"]["models"][missing]["loads"] == models[missing]["loads"] + 1
    # interleaved and concurrent too: each request waits for its model's switch
    jobs = [(name, i) for i in range(len(PROMPTS)) for name in MODELS]
    with ThreadPoolExecutor(6) as pool:
        texts = list(pool.map(lambda job: complete(tight, job[0], PROMPTS[job[1]]), jobs))
    assert texts == [expected[job] for job in jobs]


def test_a_model_larger_than_the_pool_fails_the_start_with_one_line(tmp_path, model_dirs):
    srv = start_server(tmp_path, "small", MODEL=model_list(model_dirs), POOL_MEMORY_GB="0.0001",
                       MAX_MODEL_LEN="256")
    try:
        assert srv.process.wait(timeout=60) == 2
    finally:
        srv.stop()
    (line,) = [line for line in srv.log().splitlines() if line.startswith("faas-bootstrap: ")]
    assert "cpu: model 'tiny-llama' needs at least" in line and "the pool holds 0.1 MiB" in line


def device_loads(srv) -> dict[str, dict[str, int]]:
    """model -> device -> loads, from /health."""
    out: dict[str, dict[str, int]] = {}
    for device, pool in http_get(srv, "/health")["pools"].items():
        for name, m in pool["models"].items():
            out.setdefault(name, {})[device] = m["loads"]
    return out


@pytest.mark.parametrize("policy, placed", [
    # a is made resident on cpu:0 at start; b goes where it fits without evicting a, then stays there
    ("affinity", {"a": {"cpu:0": 1, "cpu:1": 0}, "b": {"cpu:0": 0, "cpu:1": 1}}),
    # each model's devices in turn: b is loaded on both, a's second and fourth requests load it on cpu:1
    ("round-robin", {"a": {"cpu:0": 1, "cpu:1": 1}, "b": {"cpu:0": 1, "cpu:1": 1}}),
    # each model on one device, its engine only there
    ("fixed", {"a": {"cpu:0": 1}, "b": {"cpu:1": 1}}),
])
def test_placement_over_two_simulated_devices(tmp_path_factory, model_dirs, expected, policy, placed):
    two = {"a": model_dirs["tiny-llama"], "b": model_dirs["tiny-qwen2"]}
    srv = start_server(tmp_path_factory.mktemp(policy), policy, MODEL=model_list(two), API_KEY=API_KEY,
                       MAX_MODEL_LEN="256", MAX_NUM_SEQS="4", POOL_MEMORY_GB="1", POOL_CPU_DEVICES="2",
                       PLACEMENT=policy)
    try:
        srv.wait_ready()
        for name in ("a", "b", "a", "b", "a", "b"):
            source = "tiny-llama" if name == "a" else "tiny-qwen2"
            assert complete(srv, name, PROMPTS[0]) == expected[(source, 0)]
        assert device_loads(srv) == placed
        assert http_get(srv, "/health")["placement"] == policy
    finally:
        srv.stop()


def faas_build(*args: str, **settings: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "snapshots.build", *args], cwd=REPO,
                          env=server_env(**{"MAX_MODEL_LEN": "256", "MAX_NUM_SEQS": "4"} | settings),
                          capture_output=True, text=True, timeout=300)


def test_faas_build_bakes_every_model_and_the_instance_serves_the_layouts(tmp_path, model_dirs, expected):
    out, snapshots = tmp_path / "baked" / "models", tmp_path / "baked" / "snapshots"
    two = {"llama": model_dirs["tiny-llama"], "qwen3": model_dirs["tiny-qwen3"]}
    r = faas_build("--model", model_list(two), "--out", str(out), "--snapshot-dir", str(snapshots), "--dtype",
                   "float32", "--chunk-mb", "0.125", "--quiet")
    assert r.returncode == 0, r.stderr
    assert sorted(p.name for p in out.iterdir()) == ["llama", "qwen3"]
    assert all((out / name / "manifest.json").is_file() for name in two)
    instance = r.stderr.index("the instance (every model's engine):")
    for name in two:  # each model's own snapshot was considered: it cannot be baked on this machine
        section = r.stderr[r.stderr.index(f"{name}:\nsnapshots:"):instance]
        assert "materialized  skipped" in section and "needs a GPU" in section and "\n  process " not in section
    # the CRIU kinds once, for the instance (tests/snapshots/test_multi_model_snapshot.py restores its process
    # snapshot); no gpu snapshot for several models
    assert "\n  process " in r.stderr[instance:]
    assert "gpu           skipped" in r.stderr[instance:] and "has no gpu snapshot" in r.stderr[instance:]
    served = f"llama={out / 'llama'},qwen3={out / 'qwen3'}"
    assert f"boot with MODEL={served}" in r.stderr
    srv = start_server(tmp_path, "baked", MODEL=served, SNAPSHOT_DIR=str(snapshots), API_KEY=API_KEY,
                       MAX_MODEL_LEN="256", MAX_NUM_SEQS="4", POOL_MEMORY_GB="1", RESTORE="materialized")
    try:
        srv.wait_ready()
        assert complete(srv, "qwen3", PROMPTS[1]) == expected[("tiny-qwen3", 1)]
        assert complete(srv, "llama", PROMPTS[2]) == expected[("tiny-llama", 2)]
        health = http_get(srv, "/health")
        assert health["restore_path"] == "cold" and "no materialized snapshot" in health["skipped"]["materialized"]
        assert health["skipped"]["process"] == "RESTORE=materialized"
        pool = health["pools"]["cpu"]["models"]
        manifest = json.loads((out / "qwen3" / "manifest.json").read_text())
        assert pool["qwen3"]["total_bytes"] == sum(f["size"] for f in manifest["files"])
    finally:
        srv.stop()


def test_faas_build_refuses_a_malformed_list_and_leaves_nothing(tmp_path, model_dirs):
    out = tmp_path / "models"
    r = faas_build("--model", f"a={model_dirs['tiny-llama']},a={model_dirs['tiny-qwen2']}", "--out", str(out))
    assert r.returncode == 2 and r.stderr.strip().splitlines()[-1].startswith("faas-build: --model=")
    assert "model name 'a' must appear once" in r.stderr and not out.exists()
    r = faas_build("--model", f"a={model_dirs['tiny-llama']},b=/no/such/model", "--out", str(out), "--quiet")
    assert r.returncode == 2 and not out.exists() and not list(tmp_path.iterdir())
    # the instance's process snapshot goes to --snapshot-dir/process: no model may be baked there
    r = faas_build("--model", f"process={model_dirs['tiny-llama']},b={model_dirs['tiny-qwen2']}", "--out", str(out),
                   "--snapshot-dir", str(tmp_path / "snapshots"), "--quiet")
    assert r.returncode == 2 and r.stderr.strip().splitlines()[-1] == (
        "faas-build: --model: a model named 'process' would share --snapshot-dir/process with the instance's "
        "snapshot of that kind: name it otherwise")
    assert not list(tmp_path.iterdir())
