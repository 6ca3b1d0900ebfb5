"""The engine on a GPU: Triton kernels and CUDA graphs give the same tokens as transformers and as eager."""

import asyncio

import pytest

from tests.test_engine import (PRESETS, PROMPTS, check_async_scheduling_changes_no_output,
                               check_constraints_in_mixed_batches, check_penalties_match_transformers, collect,
                               hf_greedy, tokens)
from tests.test_prefix_cache import check_slices_and_prefix_hits_match_transformers

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("preset", PRESETS)
def test_cuda_graphs_greedy_matches_transformers_fp32(preset, tiny_model, engine_factory):
    model_dir = tiny_model(preset)
    engine = engine_factory(model_dir, device="cuda", dtype="float32", max_num_seqs=16, max_model_len=256,
                            gpu_memory_utilization=0.2)
    assert sorted(engine.runner.graphs) == [1, 2, 4, 8, 16]
    expected = [hf_greedy(model_dir, p, 16)[0] for p in PROMPTS]

    async def all_at_once():
        return await asyncio.gather(*[collect(engine, p, max_tokens=16, temperature=0) for p in PROMPTS])

    assert [tokens(o) for o in asyncio.run(all_at_once())] == expected
    assert engine.stats().kv_blocks_used == 0


def test_greedy_logprobs_from_the_greedy_kernel_match_transformers(tiny_model, engine_factory):
    """logprobs 0 and 1 (runtime/engine/kernels/sampling.py) beside a request without them and one asking two
    (torch's path), in one batch: each gets transformers' greedy tokens and log-probabilities."""
    import torch

    model_dir = tiny_model("tiny-llama")
    engine = engine_factory(model_dir, device="cuda", dtype="float32", max_num_seqs=8, max_model_len=256,
                            gpu_memory_utilization=0.2)
    asks = [None, 0, 1, 2]

    async def all_at_once():
        return await asyncio.gather(*[collect(engine, PROMPTS[i], max_tokens=6, temperature=0, logprobs=n)
                                      for i, n in enumerate(asks)])

    for i, (n, outs) in enumerate(zip(asks, asyncio.run(all_at_once()))):
        generated, model = hf_greedy(model_dir, PROMPTS[i], 6)
        assert tokens(outs) == generated
        if n is None:
            assert all(not out.logprobs for out in outs)
            continue
        with torch.no_grad():
            ref = torch.log_softmax(model(torch.tensor([PROMPTS[i] + generated])).logits[0].float(), dim=-1)
        for step, out in enumerate(outs):
            row = ref[len(PROMPTS[i]) - 1 + step]
            (lp,) = out.logprobs
            assert lp.logprob == pytest.approx(row[generated[step]].item(), abs=1e-4)
            assert [t for t, _, _ in lp.top] == row.topk(n).indices.tolist()
            assert [v for _, _, v in lp.top] == pytest.approx(row.topk(n).values.tolist(), abs=1e-4)


def test_bf16_graphs_equal_eager(tiny_model, engine_factory):
    engine = engine_factory(tiny_model("tiny-llama"), device="cuda", dtype="bfloat16", max_num_seqs=16,
                            max_model_len=256, gpu_memory_utilization=0.2)

    async def run():
        return await asyncio.gather(*[collect(engine, p, max_tokens=16, temperature=0) for p in PROMPTS])

    with_graphs = [tokens(o) for o in asyncio.run(run())]
    runner = engine.runner
    sizes, runner.graph_batch_sizes = runner.graph_batch_sizes, []
    try:
        eager = [tokens(o) for o in asyncio.run(run())]
    finally:
        runner.graph_batch_sizes = sizes
    assert with_graphs == eager


def test_decode_graphs_chain_the_engine_kernels_and_leave_library_kernels_plain(tiny_model, engine_factory):
    """On Hopper, consecutive engine kernels of a decode graph are joined by programmatic edges (each launches
    while the one before still runs), and an edge from an engine kernel to a cuBLAS kernel stays plain (a
    library kernel is not known to wait). test_bf16_graphs_equal_eager checks that the chained graphs give
    eager's tokens."""
    import torch

    from runtime.cuda_driver import graphs as cu
    from runtime.engine.kernels.dependent_launch import ENGINE_KERNELS, PLAIN_EDGE, PROGRAMMATIC_EDGE

    if torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("programmatic dependent launch needs compute capability 9.0 (Hopper) or later")
    engine = engine_factory(tiny_model("tiny-llama"), device="cuda", dtype="bfloat16", max_num_seqs=16,
                            max_model_len=256, gpu_memory_utilization=0.2)

    def edges(bs):
        graph = engine.runner.graphs[bs].raw_cuda_graph()
        kernels = {n: cu.kernel_node_name(n) for n in cu.graph_nodes(graph) if cu.node_type(n) == cu.NODE_KERNEL}
        return [(kernels[src], kernels[dst], edge) for dst in kernels for src, edge in cu.node_dependencies(dst)
                if src in kernels]

    layers = engine.runner.model_config.num_layers
    one_token = edges(1)
    assert all(name in ENGINE_KERNELS for src, dst, _ in one_token for name in (src, dst))
    assert {edge for *_, edge in one_token} == {PROGRAMMATIC_EDGE}
    assert len(one_token) >= 6 * layers  # norm, qkv, rotary, attention, o, norm, gate_up, down per layer
    to_library = [edge for src, dst, edge in edges(16) if src in ENGINE_KERNELS and dst not in ENGINE_KERNELS]
    assert to_library and set(to_library) == {PLAIN_EDGE}  # 16 tokens: the projections are cuBLAS's


def test_async_scheduling_with_cuda_graphs_serves_what_one_step_at_a_time_serves(tiny_model, engine_factory):
    # fp32 so that the different batches a run-ahead step makes cannot flip a near-tie
    check_async_scheduling_changes_no_output(tiny_model("tiny-llama"), engine_factory, device="cuda",
                                             dtype="float32", max_num_seqs=16, gpu_memory_utilization=0.2)


def test_penalties_on_the_device_match_transformers(tiny_model, engine_factory):
    check_penalties_match_transformers(tiny_model("tiny-llama"), engine_factory, device="cuda", dtype="float32",
                                       max_num_seqs=16, num_kv_blocks=64, gpu_memory_utilization=0.2)


def test_prompt_slices_and_prefix_hits_with_cuda_graphs_match_transformers(tiny_model, engine_factory):
    """Slices of 24 tokens through the Triton attention, prompts that find a 32-token prefix cached, and
    decodes on the CUDA graphs, all in the same steps: transformers' greedy tokens."""
    check_slices_and_prefix_hits_match_transformers(tiny_model("tiny-llama"), engine_factory, device="cuda",
                                                    gpu_memory_utilization=0.2)


def test_grammar_masks_and_logit_bias_beside_cuda_graphs(tiny_model, engine_factory):
    """Decode steps run in CUDA graphs; grammar masks, logit_bias and min_tokens act on their logits after
    the graph, for the rows that ask for them only."""
    check_constraints_in_mixed_batches(tiny_model("tiny-llama"), engine_factory, device="cuda", dtype="float32",
                                       max_num_seqs=16, gpu_memory_utilization=0.2)


def test_prompt_tokens_after_a_cached_prefix_run_in_the_decode_graphs(tiny_model, engine_factory):
    """Prompts that find a 32-token prefix cached compute their own 6 to 30 tokens one token per row of a
    decode graph when the step fits one (16 rows here): transformers' greedy tokens."""
    model_dir = tiny_model("tiny-llama")
    engine = engine_factory(model_dir, device="cuda", dtype="float32", max_num_seqs=16, max_model_len=256,
                            gpu_memory_utilization=0.2)
    runner, in_rows = engine.runner, []
    replay_rows = runner._forward_graph_rows

    def counted(bs, batch, blocks, pending):
        in_rows.append(batch.num_tokens)
        return replay_rows(bs, batch, blocks, pending)

    runner._forward_graph_rows = counted
    prompts = [PROMPTS[7] + p for p in PROMPTS[:5]]
    expected = [hf_greedy(model_dir, p, 16)[0] for p in prompts]
    outs = [asyncio.run(collect(engine, p, max_tokens=16, temperature=0)) for p in prompts]
    assert [tokens(o) for o in outs] == expected
    assert [o[-1].cached_tokens for o in outs] == [0, 32, 32, 32, 32]
    assert in_rows == [len(p) - 32 for p in prompts[1:] if len(p) - 32 <= 16] != []


def test_memory_another_process_takes_while_an_engine_starts_is_not_charged_to_its_kv_share(tiny_model,
                                                                                            engine_factory):
    """Instances starting side by side on one GPU: the KV profile charges the engine with its own memory only,
    so 20 GiB taken by another process between two profiles leaves the cache the same size."""
    import subprocess
    import sys

    # a small fixed cache, so that the profiles below size one from the share the engine has not spent yet
    engine = engine_factory(tiny_model("tiny-llama"), device="cuda", dtype="float32", max_num_seqs=16,
                            max_model_len=256, num_kv_blocks=64, gpu_memory_utilization=0.3)
    alone = engine.runner.profile_kv_blocks().num_blocks
    hold = ("import sys, torch; x = torch.empty(20 << 30, dtype=torch.uint8, device='cuda'); "
            "print('held', flush=True); sys.stdin.read()")
    holder = subprocess.Popen([sys.executable, "-c", hold], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline() == "held\n"
        beside = engine.runner.profile_kv_blocks()
    finally:
        holder.communicate("", timeout=60)
    assert beside.total_bytes - beside.free_bytes_after_profile >= 20 << 30  # the other process's memory is taken
    assert abs(beside.num_blocks - alone) <= alone // 100


def test_attention_split_in_parts_matches_the_reference_on_the_device():
    """The split launches' merge relies on the device's memory ordering (a count per program, the last part
    reading the others' results), which Triton's interpreter on a CPU does not exercise."""
    from tests.test_kernels import test_paged_attention_split_in_parts_matches_reference_and_is_ready_again as check

    for query_lens, seq_lens, block_q in (([1, 1], [700, 30], 1), ([1, 1, 1], [1100, 520, 449], 1),
                                          ([6, 1], [640, 900], 4), ([1] * 8, [3000 + 37 * i for i in range(8)], 1)):
        check(query_lens, seq_lens, block_q)
