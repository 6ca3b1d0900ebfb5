"""Several models in one real server on two GPUs: each GPU gets its own pool and engines (cuda:0, cuda:1),
every model answers as it does alone, and the placement decides where each model lives."""

from __future__ import annotations

import pytest

from tests.server.conftest import API_KEY, start_server
from tests.server.test_multi_model import PROMPTS, complete, http_get, model_list

pytestmark = pytest.mark.gpu

TWO = ("tiny-llama", "tiny-qwen3")
ENGINE = {"DEVICE": "cuda", "MAX_MODEL_LEN": "256", "MAX_NUM_SEQS": "4", "CUDA_VISIBLE_DEVICES": "0,1",
          "GPU_MEMORY_UTILIZATION": "0.3"}


@pytest.fixture(scope="module")
def two_gpus():
    import torch

    if torch.cuda.device_count() < 2:
        pytest.skip(f"needs two GPUs; this machine has {torch.cuda.device_count()}")


@pytest.fixture(scope="module")
def alone(two_gpus, tiny_model, tmp_path_factory):
    """Each model's answers served alone on one GPU."""
    answers = {}
    for name in TWO:
        srv = start_server(tmp_path_factory.mktemp(f"alone-{name}"), "alone", MODEL=tiny_model(name),
                           SERVED_MODEL_NAME=name, API_KEY=API_KEY, **ENGINE | {"CUDA_VISIBLE_DEVICES": "0"})
        try:
            srv.wait_ready(timeout=300)
            answers.update({(name, i): complete(srv, name, p) for i, p in enumerate(PROMPTS)})
        finally:
            srv.stop()
    return answers


def _serve_alternating(tmp_path, tiny_model, alone, placement: str) -> dict:
    srv = start_server(tmp_path, placement, MODEL=model_list({n: tiny_model(n) for n in TWO}), API_KEY=API_KEY,
                       PLACEMENT=placement, **ENGINE)
    try:
        srv.wait_ready(timeout=300)
        jobs = [(name, i) for i in range(len(PROMPTS)) for name in TWO] * 2
        assert [complete(srv, name, PROMPTS[i]) for name, i in jobs] == [alone[job] for job in jobs]
        return http_get(srv, "/health")["pools"]
    finally:
        assert srv.stop() == 0


def test_fixed_placement_keeps_each_model_on_its_gpu(tmp_path, tiny_model, alone):
    pools = _serve_alternating(tmp_path, tiny_model, alone, "fixed")
    assert sorted(pools) == ["cuda:0", "cuda:1"]
    assert list(pools["cuda:0"]["models"]) == [TWO[0]]
    assert list(pools["cuda:1"]["models"]) == [TWO[1]]
    for pool in pools.values():
        assert all(m["loads"] == 1 for m in pool["models"].values())  # each loaded once, never switched away


def test_affinity_spreads_two_models_over_two_gpus_and_stops_switching(tmp_path, tiny_model, alone):
    pools = _serve_alternating(tmp_path, tiny_model, alone, "affinity")
    loads = {(device, name): m["loads"] for device, pool in pools.items() for name, m in pool["models"].items()}
    # the first model starts on cuda:0; the second goes where nothing needs evicting, and each stays there
    assert sum(loads.values()) == 2, loads
    assert {device for (device, _), n in loads.items() if n} == {"cuda:0", "cuda:1"}
