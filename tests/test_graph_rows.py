"""A step with prompt tokens in it, laid out one token per row as a decode CUDA graph runs it, computes the
logits the step computes as a prefill (runtime/engine/model_runner.py: graph_rows). On the CPU the rows run
through the eager forward, one-token sequences attending through the paged cache, as the graph's kernels do;
tests/test_engine_gpu.py replays them in the graphs."""

import torch

from runtime.engine.model_runner import graph_rows
from runtime.engine.sampling_params import SamplingParams
from runtime.engine.scheduler import ScheduledBatch
from runtime.engine.sequence import Sequence


def _admitted(engine, name: str, prompt: list[int]) -> Sequence:
    seq = Sequence(name, prompt, SamplingParams(max_tokens=4, temperature=0))
    engine.blocks.admit(seq, [], len(prompt))
    return seq


def _compute(runner, blocks, seq: Sequence, n: int) -> None:
    batch = ScheduledBatch([], [])
    batch.add(seq, n)
    runner.execute(batch, blocks)
    seq.num_computed_tokens += n


def _mixed_step(engine) -> ScheduledBatch:
    """The suffix of a prompt whose first 32 tokens are cached, a decoding sequence's next token, and the
    first slice of a new prompt that stops short of its end (so it samples nothing)."""
    runner, blocks = engine.runner, engine.blocks
    suffix = _admitted(engine, "suffix", list(range(3, 43)))
    _compute(runner, blocks, suffix, 32)
    decoding = _admitted(engine, "decoding", list(range(50, 70)))
    _compute(runner, blocks, decoding, 20)
    decoding.output_ids.append(7)
    blocks.grow(decoding, decoding.num_tokens)
    sliced = _admitted(engine, "sliced", list(range(80, 92)))
    batch = ScheduledBatch([], [])
    batch.add(suffix, 8)
    batch.add(decoding, 1)
    batch.add(sliced, 5)
    return batch


def test_prompt_tokens_as_graph_rows_give_the_prefill_logits(tiny_model, engine_factory):
    engine = engine_factory(tiny_model("tiny-llama"), device="cpu", dtype="float32", num_kv_blocks=64)
    runner = engine.runner
    batch = _mixed_step(engine)
    assert batch.samples == [True, True, False]
    # a prompt computed from its start stays eager (a graph's kernels round differently): not this step
    assert not batch.continues_every_prompt
    assert ScheduledBatch(batch.seqs[:2], batch.num_new_tokens[:2]).continues_every_prompt
    prefill = runner.execute(batch, engine.blocks).clone()

    rows = graph_rows(batch, engine.blocks, None)
    assert len(rows.ids) == batch.num_tokens == 14
    assert rows.sampling == [7, 8]  # the suffix's last token, then the decoding sequence's
    as_rows = runner._forward_eager(rows.ids, rows.positions, rows.slots, [1] * len(rows.ids),
                                    [p + 1 for p in rows.positions], rows.tables)
    assert torch.allclose(as_rows[rows.sampling], prefill, atol=1e-5, rtol=1e-5)
    assert prefill.argmax(-1).tolist() == as_rows[rows.sampling].argmax(-1).tolist()
