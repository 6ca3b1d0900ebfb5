"""The CPU path (what a function without a GPU runs): its attention and projections against the references,
and its greedy text against transformers'."""

import asyncio
import os
from pathlib import Path

import pytest
import torch

from runtime.engine.cpu.attention import paged_attention_cpu
from runtime.engine.layers.attention import paged_attention_reference
from tests.test_engine import PROMPTS, collect, hf_greedy, tokens
from tests.test_kernels import paged_batch


@pytest.mark.parametrize("query_lens,seq_lens", [
    ([1, 1, 1], [1, 17, 130]),                   # decode
    ([1] * 8, [3, 16, 17, 64, 65, 100, 1, 33]),  # a decode batch: lengths across block edges, one of one token
    ([40], [40]),                                # a whole prompt
    ([5, 1, 20, 1], [5, 30, 37, 64]),            # prefill, decode and a prompt slice after cached context, mixed
    ([33], [100]),                               # a prompt continued after a prefix already cached
    ([7, 1, 31, 16], [40, 17, 95, 64]),          # slices starting mid-block
])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("with_new_kv", [False, True], ids=["cache", "new-kv"])
@pytest.mark.parametrize("scattered", [True, False], ids=["scattered", "consecutive"])
def test_cpu_attention_matches_reference(query_lens, seq_lens, dtype, with_new_kv, scattered):
    q, k, v, meta = paged_batch(query_lens, seq_lens, heads=6, kv_heads=2, dtype=dtype, scattered=scattered)
    expected = paged_attention_reference(q, k, v, meta, 32 ** -0.5).float()
    new_kv = step_kv(k, v, meta) if with_new_kv else None  # whole prompts read their keys from there
    got = paged_attention_cpu(q, k, v, meta, 32 ** -0.5, new_kv).float()
    assert (got - expected).abs().max() < (1e-5 if dtype == torch.float32 else 2e-2)


def step_kv(k_cache, v_cache, meta):
    """The keys and values of the step's tokens, [T, kv_heads, head_dim], read back from their cache slots."""
    block_size = k_cache.shape[1]
    slots = []
    for i, seq_len in enumerate(meta.seq_lens_cpu):
        num_q = meta.query_start_loc_cpu[i + 1] - meta.query_start_loc_cpu[i]
        slots += [int(meta.block_tables[i, p // block_size]) * block_size + p % block_size
                  for p in range(seq_len - num_q, seq_len)]
    return k_cache.flatten(0, 1)[slots], v_cache.flatten(0, 1)[slots]


def on_grid(w, bits):
    """`w` quantised as llama.cpp's Q4_1 (d, m: the group's range) or Q8_0 (d: its largest magnitude) and back."""
    g = w.reshape(-1, 32)
    if bits == 4:
        low = g.amin(-1, keepdim=True)
        d, m = ((g.amax(-1, keepdim=True) - low) / 15).half().float(), low.half().float()
        return (d * ((g - m) / d).round().clamp(0, 15) + m).reshape(w.shape)
    d = (g.abs().amax(-1, keepdim=True) / 127).half().float()
    return (d * (g / d).round().clamp(-127, 127)).reshape(w.shape)


def grouped_weight(n, k, bits, g):
    """[n, k] float32 whose groups of 32 are exactly Q4_1 (d*q + m) or Q8_0 (d*q) values, as a GGUF imports."""
    groups = n * k // 32
    d = (torch.rand(groups, 1, generator=g) * 0.02 + 0.001).half().float()
    if bits == 4:
        q = torch.randint(0, 16, (groups, 32), generator=g)
        q[:, 0], q[:, 1] = 0, 15                     # the quantiser maps each group's min to 0, its max to 15
        m = (torch.rand(groups, 1, generator=g) * -0.1).half().float()
        return (d * q + m).reshape(n, k)
    q = torch.randint(-127, 128, (groups, 32), generator=g)
    q[:, 0] = 127                                    # and the largest magnitude to 127
    return (d * q).reshape(n, k)


def built_kernels():
    from runtime.engine.cpu.packed import packed_kernels

    kernels = packed_kernels()
    if kernels is None:
        pytest.skip("the packed CPU kernel is not built or this CPU lacks AVX2/FMA/F16C (pip install -e . builds "
                    "runtime/engine/cpu/packed_gemv.c)")
    return kernels


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("tokens", [1, 3, 8])
def test_packed_projection_matches_linear(bits, tokens):
    kernels = built_kernels()
    g = torch.Generator().manual_seed(bits * 10 + tokens)
    weight, bias = grouped_weight(200, 96, bits, g), torch.randn(200, generator=g)
    packed = kernels.pack(weight)
    assert packed is not None and packed.bits == bits
    assert packed.nbytes == 200 * 96 // 32 * (20 if bits == 4 else 34)
    x = torch.randn(tokens, 96, generator=g)
    expected = torch.nn.functional.linear(x.double(), weight.double(), bias.double())
    assert (kernels.gemv(x, packed, bias).double() - expected).abs().max() < 1e-4


def test_weights_that_are_not_exact_groups_stay_float():
    kernels = built_kernels()
    g = torch.Generator().manual_seed(0)
    q4 = grouped_weight(64, 64, 4, g)
    q4[5, 7] += 1e-3                                 # one value off the grid: neither 4- nor 8-bit exact
    assert kernels.pack(q4) is None
    assert kernels.pack(torch.randn(64, 64, generator=g)) is None
    assert kernels.pack(grouped_weight(64, 48, 4, g)[:, :40].contiguous()) is None   # k not a multiple of 32


@pytest.fixture(scope="module")
def grouped_model(tiny_model, tmp_path_factory):
    """tiny-qwen2 (tied embeddings) with every projection's weights on the Q4_1 grid and the embedding (the
    tied lm_head) on Q8_0's, as an imported Q4_1 GGUF has them."""
    import shutil

    from safetensors.torch import load_file, save_file

    source = Path(tiny_model("tiny-qwen2"))
    out = tmp_path_factory.mktemp("grouped")
    for f in source.iterdir():
        shutil.copy(f, out / f.name)
    state = load_file(source / "model.safetensors")
    for name, w in state.items():
        if w.dim() == 2:
            state[name] = on_grid(w, 8 if "embed" in name else 4)
    save_file(state, out / "model.safetensors", metadata={"format": "pt"})
    return str(out)


def test_packed_engine_gives_transformers_greedy_tokens(grouped_model, engine_factory):
    """Decode steps of 1 and 8 sequences through the packed weights; prompts through float32: the same tokens as
    transformers in float32, and as the engine with packing off."""
    from runtime import timeline as stages

    built_kernels()
    prompts = [PROMPTS[3]] + PROMPTS
    expected = [hf_greedy(grouped_model, p, 12)[0] for p in prompts]
    packed = engine_factory(grouped_model, max_num_seqs=8)
    assert packed.timeline.get(stages.WEIGHTS).detail["packed_layers"] == 2 * 4 + 1   # qkv, o, gate_up, down; head
    plain = engine_factory(grouped_model, max_num_seqs=8, cpu_packed_weights=False)
    assert "packed_layers" not in plain.timeline.get(stages.WEIGHTS).detail

    async def greedy(engine, batch):
        return [tokens(o) for o in await asyncio.gather(*[collect(engine, p, max_tokens=12, temperature=0)
                                                          for p in batch])]

    assert all(len(set(e)) > 3 for e in expected)                          # text, not one token repeated
    threads = torch.get_num_threads()
    for engine in (packed, plain):
        assert asyncio.run(greedy(engine, prompts[:1])) == expected[:1]
        assert asyncio.run(greedy(engine, prompts[1:])) == expected[1:]
        # the packed engine's decode steps ran torch's ops on one thread and gave the threads back
        assert engine.runner.packed_steps == (engine is packed) and torch.get_num_threads() == threads


def test_threads_follow_the_cgroup_quota(tmp_path):
    from runtime.engine.cpu.threads import cpu_quota, cpu_threads

    visible = len(os.sched_getaffinity(0))
    assert cpu_quota(tmp_path) is None and cpu_threads(tmp_path) == visible      # no cgroup files: no limit
    (tmp_path / "cpu.max").write_text("max 100000\n")
    assert cpu_quota(tmp_path) is None and cpu_threads(tmp_path) == visible
    (tmp_path / "cpu.max").write_text("50000 100000\n")                          # half a CPU: one thread
    assert cpu_quota(tmp_path) == 0.5 and cpu_threads(tmp_path) == 1
    (tmp_path / "cpu.max").write_text(f"{100000 * (visible + 3)} 100000\n")      # more than visible: visible
    assert cpu_threads(tmp_path) == visible
    (tmp_path / "cpu.max").unlink()
    (tmp_path / "cpu").mkdir()
    (tmp_path / "cpu" / "cpu.cfs_quota_us").write_text("150000\n")               # cgroup v1
    (tmp_path / "cpu" / "cpu.cfs_period_us").write_text("100000\n")
    assert cpu_quota(tmp_path) == 1.5 and cpu_threads(tmp_path) == min(2, visible)
