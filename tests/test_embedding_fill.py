"""The embedding table's rows read after ready (EMBEDDING_LAST; runtime/engine/embedding_fill.py), on the CPU
with real layout files: faas-build writes each block's digest for an untied table only, the prefetch reads the
deferred part last, an engine whose table misses that part answers as one with all of it (reading only the rows
its steps need), a block that fails its check fails just the requests that need its rows, and block digests that
do not match the manifest leave the engine to read the rest before it serves."""

from __future__ import annotations

import asyncio
import json
import logging

import pytest
import torch

from runtime.engine import Engine, EngineConfig, SamplingParams
from runtime.weights import prefetch
from runtime.weights.embedding_blocks import BLOCKS_FILE, EmbeddingBlocks, deferred_chunks, raw_deferred_span
from runtime.weights.errors import WeightsError
from runtime.weights.layout import write_layout
from runtime.weights.loader import LayoutLoader, layout_chunks
from runtime.weights.manifest import Manifest

CHUNK = 1 << 13  # the tiny table (512 rows of 64 float32) holds 16 whole chunks
PROMPT_A = [5, 9, 33, 100, 7]
PROMPT_B = [300, 301, 302]


@pytest.fixture
def layout(tiny_model, tmp_path):
    out = tmp_path / "tiny-llama"
    write_layout(tiny_model("tiny-llama"), str(out), dtype="float32", file_bytes=200_000, chunk_bytes=CHUNK,
                 progress=False)
    return out


@pytest.fixture
def engine(layout):
    engine = Engine.build(layout, LayoutLoader(layout), EngineConfig(device="cpu", max_model_len=256))
    engine.start()
    yield engine
    engine.shutdown()


def generate(engine, prompt, n=6):
    async def run():
        return [o async for o in engine.generate(prompt, SamplingParams(max_tokens=n, temperature=0, logprobs=1,
                                                                         ignore_eos=True))]

    outs = asyncio.run(run())
    return [t for o in outs for t in o.token_ids], [round(lp.logprob, 5) for o in outs for lp in o.logprobs]


def table_blocks(layout) -> tuple[EmbeddingBlocks, frozenset[int]]:
    manifest = Manifest.read(layout)
    return EmbeddingBlocks.read(layout, manifest), deferred_chunks(manifest)


def drop_deferred(engine, layout) -> tuple[torch.Tensor, frozenset[int]]:
    """Zero the deferred chunks in the engine's weight buffer, as a restore whose helper left them out has them;
    returns the buffer as it was and those chunks."""
    buffer = engine.runner.weight_buffer
    whole = buffer.clone()
    deferred = deferred_chunks(Manifest.read(layout))
    for i, c in enumerate(layout_chunks(Manifest.read(layout))):
        if i in deferred:
            buffer[c.buffer_offset:c.buffer_offset + c.length] = 0
    return whole, deferred


def test_faas_build_writes_block_digests_for_an_untied_table_only(tiny_model, layout, tmp_path):
    manifest = Manifest.read(layout)
    assert BLOCKS_FILE in manifest.model_files
    blocks, deferred = table_blocks(layout)
    table = manifest.plan.by_name()["model.embed_tokens.weight"]
    chunks = layout_chunks(manifest)
    assert len(deferred) == table.nbytes // CHUNK
    assert all(table.offset <= chunks[i].buffer_offset and chunks[i].buffer_offset + chunks[i].length
               <= table.offset + table.nbytes for i in deferred)
    data = (layout / manifest.files[0].name).read_bytes()
    assert blocks.blocks == 512 // blocks.rows_per_block
    assert blocks.check(3, data[blocks.file_offset + 3 * 2048:blocks.file_offset + 4 * 2048])
    assert not blocks.check(3, data[blocks.file_offset + 4 * 2048:blocks.file_offset + 5 * 2048])

    tied = tmp_path / "tiny-qwen2"
    write_layout(tiny_model("tiny-qwen2"), str(tied), dtype="float32", file_bytes=200_000, chunk_bytes=CHUNK,
                 progress=False)
    assert not (tied / BLOCKS_FILE).exists() and not deferred_chunks(Manifest.read(tied))


def test_the_prefetch_reads_the_deferred_part_of_the_table_last(layout, monkeypatch):
    monkeypatch.setattr(prefetch, "PIECE_BYTES", CHUNK)
    files, last = prefetch._layout(str(layout), embedding_last=True)
    name, start, end = raw_deferred_span(json.loads((layout / "manifest.json").read_bytes()))
    assert last == (str(layout / name), start, end) and end - start == 16 * CHUNK
    order = prefetch.pieces(files, last)
    assert sorted(order) == sorted(prefetch.pieces(files))
    assert order[0][0] == str(layout / BLOCKS_FILE)  # the runtime reads it while the weights arrive
    assert [p[1] for p in order[-16:]] == list(range(start, end, CHUNK))
    assert all(p[0] == str(layout / name) for p in order[-16:])
    assert prefetch._layout(str(layout), embedding_last=False) == (prefetch.layout_files(str(layout)), None)


def test_an_engine_missing_the_table_answers_alike_reading_only_the_rows_it_needs(engine, layout):
    expected = generate(engine, PROMPT_A)
    whole, deferred = drop_deferred(engine, layout)
    engine.defer_embedding(deferred, engine.runner.weight_buffer, fill_now=False)
    fill = engine.embedding_fill
    engine.reset_step_counts()
    assert generate(engine, PROMPT_A) == expected
    blocks, _ = table_blocks(layout)
    used = {t // blocks.rows_per_block for t in PROMPT_A + expected[0][:-1]}  # the last token is never fed
    assert fill.on_demand_blocks == len(used)
    table = engine.runner.weight_buffer[blocks.buffer_offset:blocks.buffer_offset + blocks.rows * blocks.row_bytes]
    untouched = [k for k in range(blocks.blocks) if k not in used]
    offset, n = blocks.block_bytes(untouched[0])
    assert not table[offset:offset + n].any()  # never read: no step needed its rows
    assert engine.stats().steps_run_ahead == 0  # each step's tokens were read before the next was launched

    fill.start()
    assert fill.complete.wait(30)
    assert torch.equal(engine.runner.weight_buffer, whole)
    generate(engine, PROMPT_B)
    assert engine.embedding_fill is None and engine.stats().steps_run_ahead > 0
    stage = engine.timeline.get("embedding_after_ready")
    assert stage.detail["bytes"] == 16 * CHUNK and stage.detail["blocks_on_demand"] == fill.on_demand_blocks


def test_a_block_failing_its_check_fails_only_the_requests_that_need_its_rows(engine, layout, caplog):
    expected_b = generate(engine, PROMPT_B)
    blocks, _ = table_blocks(layout)
    bad = 33 // blocks.rows_per_block  # PROMPT_A's third token
    assert bad not in {t // blocks.rows_per_block for t in PROMPT_B + expected_b[0]}
    drop_deferred(engine, layout)
    offset, _ = blocks.block_bytes(bad)
    with open(blocks.file, "r+b") as f:  # one byte of row 33 changed after the build
        f.seek(blocks.file_offset + offset + 33 % blocks.rows_per_block * blocks.row_bytes)
        byte = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([byte[0] ^ 0xFF]))
    engine.defer_embedding(deferred_chunks(Manifest.read(layout)), engine.runner.weight_buffer, fill_now=False)

    with pytest.raises(RuntimeError, match=f"embedding table block {bad} .*fails its xxh3-128 check"):
        generate(engine, PROMPT_A)
    assert generate(engine, PROMPT_B) == expected_b
    with caplog.at_level(logging.ERROR, logger="thawllm.engine.embedding_fill"):
        engine.embedding_fill.start()
        engine.embedding_fill._thread.join(30)
    assert not engine.embedding_fill.complete.is_set() and bad in engine.embedding_fill.failed
    assert engine.timeline.get("embedding_after_ready").detail["failed_blocks"] == 1
    with pytest.raises(RuntimeError, match="fails its xxh3-128 check"):
        generate(engine, PROMPT_A)


def test_block_digests_unlike_the_manifest_are_refused_and_the_table_read_before_serving(engine, layout):
    with open(layout / BLOCKS_FILE, "r+b") as f:
        f.seek(40)
        f.write(b"\0" * 8)
    with pytest.raises(WeightsError, match=f"{BLOCKS_FILE} does not match the layout's manifest"):
        table_blocks(layout)
    whole, deferred = drop_deferred(engine, layout)
    engine.defer_embedding(deferred, engine.runner.weight_buffer)
    assert engine.embedding_fill is None
    assert torch.equal(engine.runner.weight_buffer, whole)
