"""The pipelined loader on a GPU: pinned ring, side stream, per-tensor readiness (skipped without CUDA)."""

from pathlib import Path

import pytest
import torch

from runtime.engine.model_config import ModelConfig
from runtime.engine.weight_plan import plan_weights
from runtime.weights.hf_dir import hf_dir_loader
from runtime.weights.layout import write_layout
from runtime.weights.loader import LoaderOptions, layout_loader
from tests.weights_helpers import cpu_settings, greedy, start

pytestmark = pytest.mark.gpu


def test_layout_streams_to_the_gpu_byte_for_byte_and_text_is_unchanged(tiny_model, tmp_path):
    src = tiny_model("tiny-qwen3")
    layout = tmp_path / "layout"
    write_layout(src, str(layout), dtype="bfloat16", file_bytes=100_000, chunk_bytes=40_000, progress=False)
    plan = plan_weights(ModelConfig.from_dir(src), "bfloat16")
    expected = torch.zeros(plan.total_bytes, dtype=torch.uint8, device="cuda")
    hf_dir_loader(Path(src))(plan, expected).wait()
    got = torch.full((plan.total_bytes,), 3, dtype=torch.uint8, device="cuda")
    load = layout_loader(layout, LoaderOptions(threads=4, read_bytes=16_384, slots_per_thread=2))(plan, got)
    first = plan.tensors[0]
    load.wait_tensor(first.name)  # usable on the current stream before the whole load is waited for
    span = slice(first.offset, first.offset + first.nbytes)
    assert torch.equal(got[span], expected[span])
    load.wait()
    assert torch.equal(got, expected)

    settings = cpu_settings(tmp_path / "cache", DEVICE="cuda", DTYPE="bfloat16", ENFORCE_EAGER="1")
    assert greedy(start(str(layout), settings)) == greedy(start(src, settings))
