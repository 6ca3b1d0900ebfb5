"""The device checksum of weight chunks: the GPU kernel (in Triton's interpreter on a machine without a GPU)
agrees with what faas-build records, and it catches the damage a plain sum would miss."""

import numpy as np
import pytest
import torch

from runtime.weights.device_checksum import add_partials, chunk_sum, device_chunk_sums
from runtime.weights.layout import write_layout
from runtime.weights.manifest import Manifest

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def kernel_sums(data: bytes, spans: list[tuple[int, int]]) -> list[str]:
    buffer = torch.frombuffer(bytearray(data), dtype=torch.uint8).to(DEVICE)
    return add_partials(device_chunk_sums(buffer, spans).cpu().numpy())


def test_the_kernel_reproduces_the_checksums_faas_build_records(tiny_model, tmp_path):
    layout = tmp_path / "layout"
    write_layout(tiny_model("tiny-llama"), str(layout), dtype="bfloat16", file_bytes=150_000,
                 chunk_bytes=40_002 * 4, progress=False)
    manifest = Manifest.read(layout)
    assert manifest.has_device_sums
    buffer = b"".join((layout / f.name).read_bytes() for f in manifest.files)
    for entry in manifest.files:
        spans = [(entry.buffer_offset + off, n) for off, n in entry.chunks()]
        assert kernel_sums(buffer, spans) == list(entry.device_sums)


def test_chunks_ending_inside_a_word_and_empty_ones():
    data = np.random.default_rng(1).integers(0, 256, size=10_007, dtype=np.uint8).tobytes()
    spans = [(0, 10_007), (4, 1), (8, 6), (12, 0), (4096, 5000)]
    assert kernel_sums(data, spans) == [chunk_sum(data[s:s + n]) for s, n in spans]


@pytest.mark.parametrize("damage", ["one bit", "a bit in the last partial word", "two words swapped",
                                    "top bits of two words", "a block moved by one word"])
def test_damage_changes_the_checksum(damage):
    data = bytearray(np.random.default_rng(2).integers(0, 256, size=64 * 1024 + 3, dtype=np.uint8).tobytes())
    original = bytes(data)
    before = chunk_sum(original)
    if damage == "one bit":
        data[30_001] ^= 0x10
    elif damage == "a bit in the last partial word":
        data[-1] ^= 0x01
    elif damage == "two words swapped":  # a plain sum of the words would not change
        data[0:4], data[400:404] = data[400:404], data[0:4]
    elif damage == "top bits of two words":  # a sum of position-weighted words mod 2**64 can cancel these
        data[3] ^= 0x80
        data[7] ^= 0x80
    else:
        data[1000:5000] = data[1004:5004]
    assert bytes(data) != original
    assert chunk_sum(bytes(data)) != before
    assert kernel_sums(bytes(data), [(0, len(data))]) == [chunk_sum(bytes(data))]
