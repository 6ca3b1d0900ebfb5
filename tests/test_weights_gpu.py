"""The pipelined loader on a GPU: pinned ring, side stream, per-tensor readiness (skipped without CUDA)."""

from pathlib import Path

import pytest
import torch

from runtime.engine.model_config import ModelConfig
from runtime.engine.weight_plan import plan_weights
from runtime.weights.hf_dir import hf_dir_loader
from runtime.weights.layout import write_layout
from runtime.weights.loader import LoaderOptions, LayoutLoader
from tests.weights_helpers import cpu_settings, greedy, start

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("reads", ["native", "python"])
def test_layout_streams_to_the_gpu_byte_for_byte_and_text_is_unchanged(tiny_model, tmp_path, reads):
    src = tiny_model("tiny-qwen3")
    layout = tmp_path / "layout"
    write_layout(src, str(layout), dtype="bfloat16", file_bytes=100_000, chunk_bytes=40_000, progress=False)
    plan = plan_weights(ModelConfig.from_dir(src), "bfloat16")
    expected = torch.zeros(plan.total_bytes, dtype=torch.uint8, device="cuda")
    hf_dir_loader(Path(src))(plan, expected).wait()
    got = torch.full((plan.total_bytes,), 3, dtype=torch.uint8, device="cuda")
    # each piece crosses the native reader's ring in four slots, wrapping round it twice
    options = LoaderOptions(threads=4, read_bytes=16_384, slots_per_thread=2, native=reads == "native",
                            native_slot_bytes=4096)
    load = LayoutLoader(layout, options)(plan, got)
    assert load.reads == reads
    first = plan.tensors[0]
    load.wait_tensor(first.name)  # usable on the current stream before the whole load is waited for
    span = slice(first.offset, first.offset + first.nbytes)
    assert torch.equal(got[span], expected[span])
    load.wait()
    assert torch.equal(got, expected)

    settings = cpu_settings(tmp_path / "cache", DEVICE="cuda", DTYPE="bfloat16", ENFORCE_EAGER="1")
    assert greedy(start(str(layout), settings)) == greedy(start(src, settings))


def _helper(layout: Path, memory_first: bool = True):
    """The weights' helper in a process of its own, as a restore starts it; returns (it, our end)."""
    import socket
    import subprocess
    import sys

    ours, theirs = socket.socketpair()
    script = ("import socket, sys; from pathlib import Path; "
              "from snapshots.weights_during_restore import stream_for_handover; "
              "stream_for_handover(Path(sys.argv[1]), socket.socket(fileno=int(sys.argv[2])), sys.argv[3] == '1'); "
              "sys.exit(3 if 'torch' in sys.modules else 0)")
    helper = subprocess.Popen([sys.executable, "-c", script, str(layout), str(theirs.fileno()), str(int(memory_first))],
                              pass_fds=(theirs.fileno(),))
    theirs.close()
    return helper, ours


@pytest.mark.parametrize("memory_first", [True, False], ids=["memory-first", "memory-after-stream"])
def test_weights_streamed_by_a_torch_free_process_map_under_the_engines_range(tiny_model, tmp_path, memory_first):
    """The restore's handover (snapshots/weights_during_restore.py) without CRIU: another process, which never
    imports torch, makes exportable memory, hands it over and streams a layout into it (or, with the memory
    after the stream, streams first); this one maps it under a released weight range as soon as it comes and,
    once the report says the weights all arrived, reads the same bytes as the torch loader wrote."""
    from runtime.engine.vmm import ReleasableBuffer
    from snapshots.weights_during_restore import ExportedWeights

    src = tiny_model("tiny-qwen3")
    layout = tmp_path / "layout"
    write_layout(src, str(layout), dtype="bfloat16", file_bytes=100_000, chunk_bytes=40_000, progress=False)
    plan = plan_weights(ModelConfig.from_dir(src), "bfloat16")
    expected = torch.zeros(plan.total_bytes, dtype=torch.uint8, device="cuda")
    LayoutLoader(layout)(plan, expected).wait()

    weights = ReleasableBuffer(plan.total_bytes, torch.device("cuda"))
    weights.release()
    helper, ours = _helper(layout, memory_first)
    exported = ExportedWeights(ours)
    taken = exported.take()
    assert taken is not None, exported.reason
    weights.adopt(*taken)
    exported.mapped(True)
    arrived = exported.arrived()
    assert arrived is not None, exported.reason
    started, finished, detail = arrived
    assert detail["bytes"] == plan.total_bytes and finished >= started > 0
    assert helper.wait(timeout=60) == 0  # 3: it imported torch
    assert torch.equal(weights.tensor[:plan.total_bytes], expected)


def test_a_chunk_that_fails_the_helpers_check_is_not_used(tiny_model, tmp_path):
    """A layout file damaged on disk: the helper's memory is mapped, then its report names the chunk; the
    range gets new memory in place of the helper's, which the restored process streams into itself."""
    from runtime.engine.vmm import ReleasableBuffer
    from runtime.weights.manifest import Manifest
    from snapshots.weights_during_restore import ExportedWeights

    layout = tmp_path / "layout"
    write_layout(tiny_model("tiny-qwen3"), str(layout), dtype="bfloat16", file_bytes=100_000, chunk_bytes=40_000,
                 progress=False)
    manifest = Manifest.read(layout)
    victim = layout / manifest.files[-1].name
    data = bytearray(victim.read_bytes())
    data[len(data) // 2] ^= 0x10
    victim.write_bytes(bytes(data))

    weights = ReleasableBuffer(manifest.plan.total_bytes, torch.device("cuda"))
    weights.release()
    helper, ours = _helper(layout)
    exported = ExportedWeights(ours)
    weights.adopt(*exported.take())
    adopted = weights._handle
    exported.mapped(True)
    assert exported.arrived() is None
    assert victim.name in exported.reason and "check" in exported.reason
    weights.replace_adopted()
    assert weights.mapped and weights._handle is not adopted
    weights.tensor.fill_(7)  # new memory, ours alone
    torch.cuda.synchronize()
    assert helper.wait(timeout=60) == 0
    assert int(weights.tensor[: manifest.plan.total_bytes].min()) == 7


def test_a_local_load_is_verified_on_the_gpu_and_a_flipped_bit_names_its_file(tiny_model, tmp_path):
    from runtime.weights.errors import WeightsError
    from runtime.weights.manifest import Manifest

    layout = tmp_path / "layout"
    write_layout(tiny_model("tiny-qwen3"), str(layout), dtype="bfloat16", file_bytes=100_000, chunk_bytes=40_000,
                 progress=False)
    manifest = Manifest.read(layout)
    buffer = torch.zeros(manifest.total_bytes, dtype=torch.uint8, device="cuda")
    load = LayoutLoader(layout)(manifest.plan, buffer).wait()
    assert load.verified == "device"
    assert buffer.cpu().numpy().tobytes() == b"".join((layout / f.name).read_bytes() for f in manifest.files)

    victim = layout / manifest.files[1].name
    data = bytearray(victim.read_bytes())
    data[len(data) // 3] ^= 0x04
    victim.write_bytes(bytes(data))
    with pytest.raises(WeightsError, match=rf"{manifest.files[1].name} chunk \d+ .* fails its device checksum check"):
        LayoutLoader(layout)(manifest.plan, buffer).wait()
    on_host = LayoutLoader(layout, LoaderOptions(verify_on_device=False))
    with pytest.raises(WeightsError, match=rf"{manifest.files[1].name} chunk \d+ .* fails its xxh3-128 check"):
        on_host(manifest.plan, buffer).wait()


def test_a_layout_without_device_checksums_is_verified_on_the_host(tiny_model, tmp_path):
    import orjson

    from runtime.weights.manifest import MANIFEST, Manifest

    layout = tmp_path / "layout"
    write_layout(tiny_model("tiny-qwen3"), str(layout), dtype="bfloat16", file_bytes=100_000, chunk_bytes=40_000,
                 progress=False)
    raw = orjson.loads((layout / MANIFEST).read_bytes())  # as faas-build wrote it before device checksums
    for entry in raw["files"]:
        del entry["device_sums"]
    (layout / MANIFEST).write_bytes(orjson.dumps(raw))
    manifest = Manifest.read(layout)
    buffer = torch.zeros(manifest.total_bytes, dtype=torch.uint8, device="cuda")
    assert LayoutLoader(layout)(manifest.plan, buffer).wait().verified == "host"
    assert buffer.cpu().numpy().tobytes() == b"".join((layout / f.name).read_bytes() for f in manifest.files)


def test_device_checks_run_group_by_group_in_any_order_and_name_the_damaged_chunk(tiny_model, tmp_path):
    import random

    from runtime.weights.device_checksum import DeviceCheck
    from runtime.weights.manifest import Manifest

    layout = tmp_path / "layout"
    write_layout(tiny_model("tiny-qwen3"), str(layout), dtype="bfloat16", file_bytes=100_000, chunk_bytes=16_384,
                 progress=False)
    manifest = Manifest.read(layout)
    data = b"".join((layout / f.name).read_bytes() for f in manifest.files)
    where = [(f, j) for f, entry in enumerate(manifest.files) for j in range(len(entry.chunks()))]
    file, j = where[len(where) // 2]
    damaged = bytearray(data)
    damaged[manifest.files[file].buffer_offset + manifest.files[file].chunks()[j][0] + 5] ^= 0x10
    for content, expected in ((data, []), (bytes(damaged), [(file, j)])):
        buffer = torch.frombuffer(bytearray(content), dtype=torch.uint8).cuda()
        check = DeviceCheck(manifest, buffer, group_bytes=40_000)  # two chunks a group
        order = list(range(len(where)))
        random.Random(1).shuffle(order)
        for chunk in order[:-1]:
            check.chunk_landed(chunk, [])
        with pytest.raises(RuntimeError, match="never checked"):
            check.mismatches()
        check.chunk_landed(order[-1], [])
        assert check.mismatches() == expected
