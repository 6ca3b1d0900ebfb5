"""The Triton kernels against the PyTorch references (in Triton's interpreter on a machine without a GPU)."""

import asyncio

import pytest
import torch
import torch.nn.functional as F

from runtime.engine.attention_metadata import AttentionMetadata
from runtime.engine.layers import dispatch
from runtime.engine.layers import rotary as rope
from runtime.engine.layers.attention import paged_attention_reference
from runtime.engine.layers.norm import rms_norm_reference

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def paged_batch(query_lens, seq_lens, heads=6, kv_heads=2, head_dim=32, block_size=16, block_q=16, dtype=torch.float32,
                scattered=True):
    g = torch.Generator().manual_seed(0)
    num_blocks = sum(-(-n // block_size) for n in seq_lens) + 3
    k_cache = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=g)
    v_cache = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=g)
    # blocks scattered over the cache, or each sequence's one after another (from the third block on)
    order = torch.randperm(num_blocks, generator=g).tolist() if scattered else list(range(2, num_blocks))
    tables, used = [], 0
    for n in seq_lens:
        count = -(-n // block_size)
        tables.append(order[used:used + count])
        used += count
    table = torch.zeros(len(tables), max(map(len, tables)), dtype=torch.int32)
    for i, row in enumerate(tables):
        table[i, :len(row)] = torch.tensor(row)
    starts = [0]
    for n in query_lens:
        starts.append(starts[-1] + n)
    tile_seq, tile_start = [], []
    for s, n in enumerate(query_lens):
        for first in range(starts[s], starts[s + 1], block_q):
            tile_seq.append(s)
            tile_start.append(first)
    q = torch.randn(starts[-1], heads, head_dim, generator=g)
    meta = AttentionMetadata(
        slot_mapping=None, query_start_loc=torch.tensor(starts, dtype=torch.int32),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32), block_tables=table,
        tile_seq=torch.tensor(tile_seq, dtype=torch.int32), tile_q_start=torch.tensor(tile_start, dtype=torch.int32),
        block_q=block_q, query_start_loc_cpu=starts, seq_lens_cpu=list(seq_lens))
    return q.to(dtype), k_cache.to(dtype), v_cache.to(dtype), meta


def on_device(meta):
    fields = {k: (v.to(DEVICE) if isinstance(v, torch.Tensor) else v) for k, v in vars(meta).items()}
    return AttentionMetadata(**fields)


@pytest.mark.parametrize("query_lens,seq_lens,block_q", [
    ([1, 1, 1], [1, 17, 130], 1),                    # decode, one tile per sequence
    ([5, 1, 20, 1], [5, 30, 37, 64], 16),            # prefill, decode and prefill-after-cache mixed
    ([33], [100], 4),                                # a prompt continued after a prefix already cached
    # slices of prompts after cached context, each starting mid-block, beside decodes (chunked prefill)
    ([7, 1, 31, 16, 1], [40, 17, 95, 64, 130], 16),
    ([3, 12, 5], [19, 77, 5], 4),                    # slices shorter and longer than a tile, and a whole prompt
])
def test_paged_attention_matches_reference(query_lens, seq_lens, block_q):
    from runtime.engine.kernels.paged_attention import paged_attention

    q, k, v, meta = paged_batch(query_lens, seq_lens, block_q=block_q)
    expected = paged_attention_reference(q, k, v, meta, 32 ** -0.5)
    got = paged_attention(q.to(DEVICE), k.to(DEVICE), v.to(DEVICE), on_device(meta), 32 ** -0.5).cpu()
    assert (got - expected).abs().max() < 1e-5



@pytest.mark.parametrize("query_lens,seq_lens,block_q", [
    ([1, 1], [700, 30], 1),                 # decodes: a long context split in parts, a short one in one pass
    ([1, 1, 1], [1100, 520, 449], 1),       # the part count's edges: every part busy, the last parts empty
    ([6, 1], [640, 900], 4),                # a question's rows after a long cached prefix, beside a decode
])
def test_paged_attention_split_in_parts_matches_reference_and_is_ready_again(query_lens, seq_lens, block_q):
    from runtime.engine.attention_metadata import SplitScratch
    from runtime.engine.kernels.paged_attention import paged_attention

    q, k, v, meta = paged_batch(query_lens, seq_lens, block_q=block_q)
    expected = paged_attention_reference(q, k, v, meta, 32 ** -0.5)
    splits, programs, rows, dim = 4, 16, 16, 32
    meta = on_device(meta)
    meta.split = SplitScratch(splits, programs, rows, dim,
                              torch.full((programs * splits * rows * 2,), float("nan"), device=DEVICE),
                              torch.full((programs * splits * rows * dim,), float("nan"), device=DEVICE),
                              torch.zeros(programs, dtype=torch.int32, device=DEVICE))
    for _ in range(2):  # the count is back at zero after each call: a second call (a graph's replay) merges again
        got = paged_attention(q.to(DEVICE), k.to(DEVICE), v.to(DEVICE), meta, 32 ** -0.5).cpu()
        assert (got - expected).abs().max() < 1e-5
        assert not meta.split.arrivals.any()
    assert not meta.split.partial_acc.isnan().all()  # the long contexts really went through the parts

def test_fused_add_norm_head_norm_and_swiglu_match_references():
    from runtime.engine.kernels.activation import silu_and_mul
    from runtime.engine.kernels.norm import rms_norm

    g = torch.Generator().manual_seed(1)
    x, r, w = torch.randn(7, 96, generator=g), torch.randn(7, 96, generator=g), torch.randn(96, generator=g)
    out, summed = rms_norm(x.clone().to(DEVICE), w.to(DEVICE), 1e-5, r.clone().to(DEVICE))
    assert torch.allclose(summed.cpu(), x + r)
    assert (out.cpu() - rms_norm_reference(x + r, w, 1e-5)).abs().max() < 1e-5
    plain = x.to(DEVICE)
    assert (rms_norm(plain, w.to(DEVICE), 1e-5).cpu() - rms_norm_reference(x, w, 1e-5)).abs().max() < 1e-5
    assert torch.equal(plain.cpu(), x)  # without a residual the input is left alone

    qkv = torch.randn(5, 8 * 16, generator=g)  # q: 4 heads of 16 dims, a view of the fused output
    q = qkv[:, :64].view(5, 4, 16)
    normed = rms_norm(q.to(DEVICE), w[:16].to(DEVICE), 1e-6).cpu()
    assert (normed - rms_norm_reference(q, w[:16], 1e-6)).abs().max() < 1e-5

    gate_up = torch.randn(3, 2 * 1500, generator=g)
    gate, up = gate_up.chunk(2, dim=-1)
    assert (silu_and_mul(gate_up.to(DEVICE)).cpu() - F.silu(gate) * up).abs().max() < 1e-5


def rotated_in_float32(x, positions, table):
    """Rotate-half rotary with each half computed in float32 and rounded to x's dtype."""
    half = x.shape[-1] // 2
    cos, sin = table[positions, :half][:, None, :], table[positions, half:][:, None, :]
    f1, f2 = x[..., :half].float(), x[..., half:].float()
    return torch.cat([(f1 * cos - f2 * sin).to(x.dtype), (f2 * cos + f1 * sin).to(x.dtype)], dim=-1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("heads,kv_heads,head_dim,tokens", [(4, 2, 16, 5), (6, 2, 32, 1), (2, 2, 256, 3)])
def test_rotary_kernel_rotates_q_and_k_and_writes_the_keys_and_values_into_their_slots(heads, kv_heads, head_dim,
                                                                                         tokens, dtype):
    from runtime.engine.kernels.rotary import rotary_store_kv
    from runtime.engine.layers.attention import store_kv

    g = torch.Generator().manual_seed(5)
    q_size, kv_size = heads * head_dim, kv_heads * head_dim
    qkv = torch.randn(tokens, q_size + 2 * kv_size, generator=g).to(dtype)  # q, k, v: views of the projection
    views = [qkv[:, :q_size], qkv[:, q_size:q_size + kv_size], qkv[:, q_size + kv_size:]]
    q, k, v = (t.view(tokens, -1, head_dim) for t in views)
    positions = torch.tensor([0, 3, 100, 7, 64][:tokens])
    slots = torch.tensor([5, 0, 23, 9, 14][:tokens])
    table = rope.cos_sin_table(128, rope.inverse_frequencies(head_dim, 10000.0, None))
    want_q, want_k = rotated_in_float32(q, positions, table), rotated_in_float32(k, positions, table)
    want_caches = [torch.zeros(6, 4, kv_heads, head_dim, dtype=dtype) for _ in range(2)]
    store_kv(want_k, v, *want_caches, slots)

    fused = qkv.clone().to(DEVICE)
    dq, dk, dv = (t.view(tokens, -1, head_dim) for t in (fused[:, :q_size], fused[:, q_size:q_size + kv_size],
                                                          fused[:, q_size + kv_size:]))
    caches = [torch.zeros(6, 4, kv_heads, head_dim, dtype=dtype, device=DEVICE) for _ in range(2)]
    rotary_store_kv(dq, dk, dv, positions.to(DEVICE), table.to(DEVICE), *caches, slots.to(DEVICE))
    got = [dq, dk, *caches]
    want = [want_q, want_k, *want_caches]
    # the interpreter rounds each float32 op as torch does (but truncates to bfloat16), while a GPU may fuse a
    # multiply and an add: the same bits, or the same up to a last bit
    if DEVICE == "cpu" and dtype != torch.bfloat16:
        assert all(torch.equal(a.cpu(), b) for a, b in zip(got, want))
    else:
        assert all((a.float().cpu() - b.float()).abs().max() <= 2 ** -6 * b.float().abs().max()
                   for a, b in zip(got, want))
    assert torch.equal(fused[:, q_size + kv_size:].cpu(), qkv[:, q_size + kv_size:])  # v itself untouched
    assert torch.equal(caches[1].cpu(), want_caches[1])  # the values, copied
    assert want_caches[0].abs().sum() > 0 and want_caches[0][4].abs().sum() == 0  # block 4: no slot there
    if dtype == torch.float32:  # the CPU path's rotary (its 16-bit math rounds otherwise)
        ref_q, ref_k = rope.apply_rotary(q, k, positions, table)
        assert (ref_q - dq.cpu()).abs().max() < 1e-5 and (ref_k - dk.cpu()).abs().max() < 1e-5


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the cpu interpreter path")
@pytest.mark.parametrize("preset", ["tiny-llama", "tiny-qwen3"])
def test_whole_model_through_the_kernels_matches_the_reference_path(preset, tiny_model, engine_factory, monkeypatch):
    model_dir = tiny_model(preset)
    reference = engine_factory(model_dir)
    together, alone = [[3, 4, 5, 6, 7], [9] * 20], [[11, 12, 13]]  # alone: one-token projections (GEMV)

    async def run(engine, prompts):
        from runtime.engine import SamplingParams

        async def one(p):
            return [t async for o in engine.generate(p, SamplingParams(max_tokens=6, temperature=0, ignore_eos=True))
                    for t in o.token_ids]
        return await asyncio.gather(*[one(p) for p in prompts])

    expected = [asyncio.run(run(reference, prompts)) for prompts in (together, alone)]
    monkeypatch.setattr(dispatch, "kernels_on_cpu", True)
    assert [asyncio.run(run(reference, prompts)) for prompts in (together, alone)] == expected


@pytest.mark.parametrize("k,bias", [(96, False), (1040, True)])   # 1040: a chunk of K past the last full one
def test_one_token_projection_matches_linear(k, bias, monkeypatch):
    from runtime.engine.kernels import gemv
    from runtime.engine.layers.linear import linear

    monkeypatch.setattr(dispatch, "kernels_on_cpu", True)
    g = torch.Generator().manual_seed(2)
    x, w = torch.randn(1, k, generator=g), torch.randn(48, k, generator=g)
    b = torch.randn(48, generator=g) if bias else None
    expected = F.linear(x, w, b)
    on = [t.to(DEVICE) if t is not None else None for t in (x, w, b)]
    assert gemv.fits(on[0], on[1], on[2], None)
    got = linear(*on).cpu()
    assert got.shape == (1, 48) and (got - expected).abs().max() < 1e-4
    out = torch.empty(1, 48, device=DEVICE)
    assert linear(*on, out=out) is out and (out.cpu() - expected).abs().max() < 1e-4


# bfloat16 on a GPU only: Triton's interpreter does not emulate a bfloat16 tl.dot
@pytest.mark.parametrize("dtype", [torch.float16] + ([torch.bfloat16] if DEVICE == "cuda" else []))
@pytest.mark.parametrize("tokens,k,bias", [(2, 96, False), (5, 1040, True), (8, 512, False)])
def test_few_token_projection_matches_linear(tokens, k, bias, dtype, monkeypatch):
    from runtime.engine.kernels import gemv
    from runtime.engine.layers.linear import linear

    monkeypatch.setattr(dispatch, "kernels_on_cpu", True)
    g = torch.Generator().manual_seed(5)
    x, w = torch.randn(tokens, k, generator=g), torch.randn(48, k, generator=g) / k ** 0.5
    b = torch.randn(48, generator=g) if bias else None
    on = [t.to(DEVICE, dtype) if t is not None else None for t in (x, w, b)]
    expected = F.linear(*[t.float() if t is not None else None for t in on]).cpu()  # same bf16 inputs, fp32 math
    assert gemv.fits(on[0], on[1], on[2], None)
    got = linear(*on).float().cpu()
    assert got.shape == (tokens, 48) and (got - expected).abs().max() < 0.03  # one 16-bit rounding of the output
    out = torch.empty(tokens, 48, device=DEVICE, dtype=dtype)
    assert linear(*on, out=out) is out and torch.equal(out.float().cpu(), got)


def test_projections_the_few_token_kernels_do_not_take_still_match_linear(monkeypatch):
    from runtime.engine.kernels import gemv
    from runtime.engine.layers.linear import linear

    monkeypatch.setattr(dispatch, "kernels_on_cpu", True)
    g = torch.Generator().manual_seed(3)
    w = torch.randn(40, 64, generator=g).to(DEVICE)
    two_tokens = torch.randn(2, 64, generator=g).to(DEVICE)           # float32: the tensor cores would round
    nine_tokens = torch.randn(9, 64, generator=g).to(DEVICE, torch.bfloat16)
    unaligned = torch.randn(1, 65, generator=g).to(DEVICE)[:, 1:]      # a view 4 bytes into its storage
    odd = torch.randn(1, 64, generator=g).to(DEVICE), torch.randn(24, 64, generator=g).to(DEVICE)[:20]
    assert not gemv.fits(two_tokens, w, None, None) and not gemv.fits(unaligned, w, None, None)
    assert not gemv.fits(nine_tokens, w.to(torch.bfloat16), None, None)
    assert not gemv.fits(odd[0], odd[1], None, None)                  # 20 rows: not a multiple of 16
    assert torch.allclose(linear(nine_tokens, w.to(torch.bfloat16)).float(),
                          F.linear(nine_tokens, w.to(torch.bfloat16)).float())
    for x, weight in ((two_tokens, w), (unaligned, w), odd):
        assert torch.allclose(linear(x, weight), F.linear(x, weight))


def test_embedding_kernel_copies_each_tokens_row():
    from runtime.engine.kernels.embedding import embedding

    g = torch.Generator().manual_seed(4)
    table = torch.randn(50, 1100, generator=g)  # 1100: a chunk of the row past the last full block
    ids = torch.tensor([7, 0, 49, 7, 23])
    got = embedding(ids.to(DEVICE), table.to(DEVICE)).cpu()
    assert torch.equal(got, F.embedding(ids, table))


def gate_up_and_weight(tokens, k, bias, dtype, seed=6):
    g = torch.Generator().manual_seed(seed)
    gate_up = torch.randn(tokens, 2 * k, generator=g).to(DEVICE, dtype)
    w = (torch.randn(48, k, generator=g) / k ** 0.5).to(DEVICE, dtype)
    return gate_up, w, (torch.randn(48, generator=g).to(DEVICE, dtype) if bias else None)


@pytest.mark.parametrize("tokens,k,bias,dtype", [
    (1, 96, False, torch.float32), (1, 1040, True, torch.float16), (1, 1040, False, torch.bfloat16),
    (1, 512, True, torch.float16)])
def test_gated_projection_gives_the_bits_of_the_gate_then_the_projection(tokens, k, bias, dtype):
    from runtime.engine.kernels.activation import silu_and_mul
    from runtime.engine.kernels.gemv import fits, gemv

    gate_up, w, b = gate_up_and_weight(tokens, k, bias, dtype)
    assert fits(gate_up, w, b, None, gated=True)
    got = gemv(gate_up, w, b, gated=True)
    assert torch.equal(got, gemv(silu_and_mul(gate_up), w, b))
    gate, up = gate_up.float().cpu().chunk(2, dim=-1)
    expected = F.linear(F.silu(gate) * up, w.float().cpu(), None if b is None else b.float().cpu())
    assert (got.float().cpu() - expected).abs().max() < (1e-4 if dtype == torch.float32 else 0.05)


def test_the_mlp_computes_its_gate_in_the_down_projection_only_at_one_token(monkeypatch):
    from runtime.engine.kernels import gemv
    from runtime.engine.layers.activation import silu_and_mul
    from runtime.engine.layers.linear import Linear

    monkeypatch.setattr(dispatch, "kernels_on_cpu", True)
    down = Linear(96, 48)
    gate_up, down.weight.data, _ = gate_up_and_weight(9, 96, False, torch.float16, seed=7)
    for tokens in (1, 3, 9):  # 3: the gate's kernel, then the few-token product; 9: the gate, then cuBLAS
        x = gate_up[:tokens]
        assert gemv.fits(x, down.weight, None, None, gated=True) == (tokens == 1)
        assert torch.equal(down.gated(x), down(silu_and_mul(x))), tokens  # the gate's kernel, then the product
    unaligned = torch.randn(1, 2 * 96 + 1).to(DEVICE)[:, 1:]
    down.weight.data = down.weight.data.float()
    assert not gemv.fits(unaligned, down.weight, None, None, gated=True)
    gate, up = unaligned.cpu().chunk(2, dim=-1)
    assert torch.allclose(down.gated(unaligned).cpu(), F.linear(F.silu(gate) * up, down.weight.cpu()), atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_greedy_kernel_gives_the_first_largest_logit_and_its_log_softmax(dtype):
    from runtime.engine.kernels.sampling import greedy_with_logprob

    g = torch.Generator().manual_seed(0)
    logits = (torch.randn(3, 5000, generator=g) * 4).to(dtype)  # more than one block of the kernel's loop
    logits[1, 4100] = logits[1, 4400] = logits[1].max() + 1  # a tie, after the first block: the first wins
    logits[2, :] = 0.5  # all equal: token 0
    rows = logits[:, :4500]  # a view whose rows are longer than its width
    tokens, chosen = greedy_with_logprob(rows.to(DEVICE))
    expected = torch.log_softmax(rows.float(), dim=-1)
    assert tokens.tolist() == rows.float().argmax(dim=-1).tolist() == [tokens[0].item(), 4100, 0]
    assert torch.allclose(chosen.cpu(), expected.gather(1, tokens.cpu()[:, None]).squeeze(1), atol=1e-5)
