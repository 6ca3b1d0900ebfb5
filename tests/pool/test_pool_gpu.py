"""The pool on a GPU: groups mapped and unmapped through CUDA VMM at fixed addresses, the decode CUDA graphs
still right after their model's weights and KV cache were given back and streamed in again, and what each
switch took, with the first activation's graphs captured beside the weight stream or after it (printed: run
with -s)."""

import json
import shutil

import pytest
import torch

from runtime.pool.pool import ModelPool, activation_bytes
from tests.pool.helpers import PROMPTS, greedy

pytestmark = pytest.mark.gpu

CONFIG = dict(device="cuda", dtype="bfloat16", max_model_len=256, max_num_seqs=8, max_num_batched_tokens=1024,
              cuda_graph_batch_sizes=(1, 2, 4, 8))


def small_model(out, tiny_dir, seed: int, hidden: int = 1024, heads: int = 16, intermediate: int = 2816) -> str:
    """A Qwen2-shaped model of ~190 MB in bfloat16 (eight 22 MB layers: about eleven 2 MiB granules each), so
    that groups map to several granules of their own; the tiny preset's tokenizer."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(seed)
    model = Qwen2ForCausalLM(Qwen2Config(vocab_size=512, hidden_size=hidden, intermediate_size=intermediate,
                                         num_hidden_layers=8, num_attention_heads=heads, num_key_value_heads=2,
                                         max_position_embeddings=512, tie_word_embeddings=False))
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.05) if p.dim() > 1 else p.uniform_(0.5, 1.5)
    model.save_pretrained(out)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(f"{tiny_dir}/{name}", out / name)
    return str(out)


@pytest.fixture(scope="module")
def layouts(tiny_model, tmp_path_factory):
    root = tmp_path_factory.mktemp("pool-gpu")
    tiny = tiny_model("tiny-qwen2")
    out = {}
    for seed, name in enumerate(("a", "b", "c")):
        model_dir = small_model(root / f"hf-{name}", tiny, seed)
        from runtime.weights.layout import write_layout

        write_layout(model_dir, str(root / name), dtype="bfloat16", chunk_bytes=4 << 20, progress=False)
        out[name] = root / name
    return out


def build(layout):
    from runtime.engine import EngineConfig
    from runtime.engine.llm_engine import Engine
    from runtime.weights.loader import LayoutLoader

    return Engine.build(layout, LayoutLoader(layout), EngineConfig(**CONFIG))


def test_mapped_range_gives_memory_back_and_keeps_addresses():
    from runtime.engine.vmm import MappedRange

    r = MappedRange(64 << 20, torch.device("cuda"))
    g = r.granule
    r.map([(0, 8 * g), (8 * g, 16 * g)])
    r.tensor[: 16 * g].fill_(7)
    r.map([(16 * g, 32 * g)])
    before = torch.cuda.mem_get_info()[0]
    r.unmap([(0, 8 * g), (8 * g, 16 * g)])
    assert torch.cuda.mem_get_info()[0] - before >= 16 * g
    address = r.tensor.data_ptr()
    r.map([(0, 16 * g)])
    r.tensor[: 16 * g].fill_(3)
    assert r.tensor.data_ptr() == address
    assert int(r.tensor[: 16 * g].sum()) == 3 * 16 * g
    r.close()


def test_unmapped_memory_is_mapped_again_before_new_memory_is_made():
    from runtime.engine.vmm import MappedRange, SpareMemory

    spares = SpareMemory(torch.device("cuda"))
    a, b = (MappedRange(64 << 20, torch.device("cuda"), spares) for _ in range(2))
    g = a.granule
    a.map([(0, 8 * g)])
    a.tensor[: 8 * g].fill_(1)
    free = torch.cuda.mem_get_info()[0]
    a.unmap([(0, 8 * g)])
    assert spares.nbytes == 8 * g
    b.map([(0, 8 * g)])  # the spare memory, not new memory
    assert spares.nbytes == 0 and abs(torch.cuda.mem_get_info()[0] - free) < g
    b.tensor[: 8 * g].fill_(2)
    assert int(b.tensor[: 8 * g].sum()) == 2 * 8 * g
    b.unmap([(0, 8 * g)])
    assert spares.release() == 8 * g
    assert torch.cuda.mem_get_info()[0] - free >= 8 * g
    b.map([(0, 8 * g)])
    b.unmap([(0, 8 * g)])
    spares.release_later()  # on its own thread; the next release waits for it
    assert spares.nbytes == 0 and spares.release() == 0
    assert torch.cuda.mem_get_info()[0] - free >= 8 * g
    a.close()
    b.close()


@pytest.mark.parametrize("proactive", [True, False], ids=["kernels-beside-stream", "kernels-after-stream"])
def test_switches_keep_graphs_right_and_stream_only_missing_groups(layouts, proactive):
    alone = {}
    for name, layout in layouts.items():
        engine = build(layout)
        engine.start()
        alone[name] = [greedy(engine, p) for p in PROMPTS]
        engine.shutdown()
    probe = ModelPool(torch.device("cuda"), 1 << 50)
    for name, layout in layouts.items():
        probe.add(name, build(layout))
    needs = {n: m.total_bytes + m.kv.least_bytes() for n, m in probe._models.items()}
    weights = min(m.total_bytes for m in probe._models.values())
    headroom = activation_bytes(probe.engine("a"))
    # two models and half the third's weights, and the activations' headroom: what torch's allocator holds
    # when the pool is made is outside its budget, and the models' own buffers fit in the headroom
    budget = needs["a"] + needs["b"] + weights // 2 + headroom
    pool = ModelPool(torch.device("cuda"), budget, proactive_kernels=proactive)
    for name, layout in layouts.items():
        pool.add(name, build(layout))
    reports = []
    try:
        for name in ["a", "b", "c", "a", "c", "b", "a", "b"]:
            report = pool.activate(name)
            pool.hold(name)
            try:
                engine = pool.engine(name)
                assert sorted(engine.runner.graphs) == [1, 2, 4, 8]
                assert [greedy(engine, p) for p in PROMPTS] == alone[name], name
            finally:
                pool.release(name)
            reports.append(report)
            print(json.dumps({k: v if not isinstance(v, float) else round(v, 4) for k, v in vars(report).items()}))
        reloads = [r for r in reports if not r.first_start and r.bytes_loaded]
        assert reloads
        for r in reloads:
            assert r.bytes_loaded + r.bytes_resident >= pool.stats().models[r.model].total_bytes * 0.99
        stats = pool.stats()
        assert stats.used_bytes <= stats.budget_bytes
        print(json.dumps({n: vars(m) for n, m in stats.models.items()}, default=str))
    finally:
        pool.shutdown()


def test_a_model_of_another_size_in_the_same_shape_classes_loads_no_triton_kernel(layouts, tmp_path, tiny_model):
    """Model "a" (hidden 1024, 8 query heads per KV head) started first; a model of other sizes in the same
    shape classes (hidden 768, 6 query heads per KV head) then starts, prefills and decodes on the kernels "a"
    loaded: its first start and first request compile or load no Triton kernel, and it answers as alone."""
    from runtime.engine.kernels.loaded import loaded_specialisations
    from runtime.weights.layout import write_layout

    other = tmp_path / "d"
    write_layout(small_model(tmp_path / "hf-d", tiny_model("tiny-qwen2"), 3, hidden=768, heads=12,
                             intermediate=2048), str(other), dtype="bfloat16", chunk_bytes=4 << 20, progress=False)
    pool = ModelPool(torch.device("cuda"), 1 << 50)
    pool.add("a", build(layouts["a"]))
    pool.add("d", build(other))
    try:
        for name in ("a", "d"):
            before = loaded_specialisations()
            report = pool.activate(name)
            pool.hold(name)
            try:
                pooled = [greedy(pool.engine(name), p) for p in PROMPTS]  # prefills and decodes of 1 to 3
            finally:
                pool.release(name)
            added = loaded_specialisations() - before
            print(json.dumps({"model": name, "kernels_loaded_at_start": report.kernels_loaded,
                              "kernels_loaded_with_first_requests": added}))
        assert added == 0 and report.kernels_loaded == 0
    finally:
        pool.shutdown()
    engine = build(other)
    engine.start()
    try:
        assert [greedy(engine, p) for p in PROMPTS] == pooled
    finally:
        engine.shutdown()
