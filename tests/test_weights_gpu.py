"""The pipelined loader on a GPU: pinned ring, side stream, per-tensor readiness (skipped without CUDA)."""

from pathlib import Path

import pytest
import torch

from runtime.engine.model_config import ModelConfig
from runtime.engine.weight_plan import plan_weights
from runtime.weights.hf_dir import hf_dir_loader
from runtime.weights.layout import write_layout
from runtime.weights.errors import WeightsError
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


def test_a_layout_in_the_page_cache_is_copied_from_it_and_still_verified(tiny_model, tmp_path):
    src = tiny_model("tiny-qwen3")
    layout = tmp_path / "layout"
    write_layout(src, str(layout), dtype="bfloat16", file_bytes=100_000, chunk_bytes=40_000, progress=False)
    plan = plan_weights(ModelConfig.from_dir(src), "bfloat16")
    expected = torch.zeros(plan.total_bytes, dtype=torch.uint8, device="cuda")
    layout_loader(layout, LoaderOptions(page_cache_dma=False))(plan, expected).wait()
    got = torch.full((plan.total_bytes,), 3, dtype=torch.uint8, device="cuda")
    load = layout_loader(layout, LoaderOptions(threads=4))(plan, got).wait()  # just written: in the page cache
    assert set(load.tier_stats()) == {"page_cache"}
    assert torch.equal(got, expected)

    victim = layout / "weights-00001.bin"
    data = bytearray(victim.read_bytes())
    data[len(data) // 2] ^= 0x01
    victim.write_bytes(bytes(data))
    with pytest.raises(WeightsError, match=r"weights-00001\.bin chunk \d+ .* fails its"):
        layout_loader(layout, LoaderOptions(threads=4))(plan, got).wait()
    victim.write_bytes(bytes(data[:1000]))  # a short file is never mapped past its end: the read reports it
    with pytest.raises(WeightsError, match=r"weights-00001\.bin: truncated"):
        layout_loader(layout, LoaderOptions(threads=4))(plan, got).wait()
