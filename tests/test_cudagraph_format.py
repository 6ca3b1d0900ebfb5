"""The materialised CUDA graph format and its relocation analysis, on node data recorded from a real
capture on the H100 (tests/fixtures/cudagraph_tiny: the tiny Llama's decode graphs for batch 1 and 2)."""

import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from runtime.engine.allocator import Allocation
from snapshots.cudagraph.records import ALLOC, SEGMENT, GraphSet, KernelNode
from snapshots.cudagraph.relocate import Region, RegionIndex, RegionTimeline
from snapshots.cudagraph.restore import allocation_mismatch, patch_parameters, trigger_batch_sizes

FIXTURE = Path(__file__).parent / "fixtures" / "cudagraph_tiny"


def regions_at_capture(bs: int) -> list[Region]:
    raw = json.loads((FIXTURE / "regions.json").read_text())["regions"][str(bs)]
    return [Region(**r) for r in raw]


def kernel_nodes(graph_set):
    return [(g.batch_size, n) for g in graph_set.graphs for n in g.nodes if isinstance(n, KernelNode)]


def test_format_round_trips(tmp_path):
    graph_set, params = GraphSet.load(FIXTURE)
    graph_set.save(tmp_path / "copy", params)
    again, params_again = GraphSet.load(tmp_path / "copy")
    assert again == graph_set and params_again == params
    assert [g.batch_size for g in graph_set.graphs] == [1, 2]
    assert any(n.name.startswith("nvjet") for _, n in kernel_nodes(graph_set))  # cuBLAS, params via extra


def test_graphs_left_unparsed_at_load_parse_later_into_the_same_records():
    whole, _ = GraphSet.load(FIXTURE)
    part, _ = GraphSet.load(FIXTURE, parse=lambda bs: bs == 1)
    assert [g.batch_size for g in part.graphs] == [1] and list(part.unparsed) == [2]
    assert part.parse_graph(2) == whole.graphs[1]
    assert part.graphs == whole.graphs and not part.unparsed


def test_unknown_format_version_is_refused(tmp_path):
    shutil.copytree(FIXTURE, tmp_path / "g")
    raw = json.loads((tmp_path / "g" / "graphs.json").read_text())
    raw["version"] = 999
    (tmp_path / "g" / "graphs.json").write_text(json.dumps(raw))
    with pytest.raises(ValueError, match="format 999"):
        GraphSet.load(tmp_path / "g")


def test_relocation_analysis_reproduces_the_gpu_side_table():
    graph_set, params = GraphSet.load(FIXTURE)
    for bs, node in kernel_nodes(graph_set):
        index = RegionIndex(regions_at_capture(bs))
        buffer = params[node.params_offset:node.params_offset + node.params_size]
        assert index.relocations(buffer) == graph_set.node_relocations(node), node.name
    # the cuBLAS GEMMs keep device pointers inside one packed struct: all of them are found
    gemm = next(n for _, n in kernel_nodes(graph_set) if n.name.startswith("nvjet"))
    assert gemm.params_size == 1720 and len(graph_set.node_relocations(gemm)) >= 6


def test_patching_moves_every_pointer_and_nothing_else():
    graph_set, params = GraphSet.load(FIXTURE)
    regions = {(r.kind, r.index): r for bs in (1, 2) for r in regions_at_capture(bs)}
    # a new process: every region somewhere else
    bases = {key: 0x7A00_0000_0000 + i * 0x10_0000_0000 for i, key in enumerate(sorted(regions))}
    patched = patch_parameters(params, graph_set.relocations, bases).tobytes()
    old_words = np.frombuffer(params, dtype=np.uint64)
    new_words = np.frombuffer(patched, dtype=np.uint64)
    moved = set()
    for _, node in kernel_nodes(graph_set):
        for r in graph_set.node_relocations(node):
            word = (node.params_offset + r.offset) // 8
            moved.add(word)
            assert int(new_words[word]) == bases[(r.kind, r.index)] + r.delta
            assert int(old_words[word]) == regions[(r.kind, r.index)].start + r.delta
    untouched = [i for i in range(len(old_words)) if i not in moved]
    assert np.array_equal(old_words[untouched], new_words[untouched])
    assert len(moved) == len(graph_set.relocations)
    first = graph_set.node_relocations(kernel_nodes(graph_set)[0][1])[0]
    del bases[(first.kind, first.index)]  # a region this process has no address for: refused, not guessed
    with pytest.raises(KeyError, match="no address for region"):
        patch_parameters(params, graph_set.relocations, bases)


def test_an_address_freed_and_reused_belongs_to_its_owner_at_capture_time():
    graph_set, params = GraphSet.load(FIXTURE)
    pool = next(r for r in regions_at_capture(1) if r.kind == SEGMENT and
                any(rel.kind == SEGMENT and rel.index == r.index for _, n in kernel_nodes(graph_set)
                    for rel in graph_set.node_relocations(n)))
    node = next(n for _, n in kernel_nodes(graph_set)
                if any(r.index == pool.index for r in graph_set.node_relocations(n)))
    buffer = params[node.params_offset:node.params_offset + node.params_size]

    timeline = RegionTimeline()
    for region in regions_at_capture(1):
        timeline.allocate(region)
    before = timeline.snapshot()           # the graph captured here used the pool segment
    timeline.free(SEGMENT, pool.index)     # later the segment is released ...
    reused = Region(SEGMENT, 999, pool.start, pool.size)
    timeline.allocate(reused)              # ... and the same addresses handed to a new one
    after = timeline.snapshot()

    assert {r.index for r in before.relocations(buffer) if r.kind == SEGMENT} == {pool.index}
    assert {r.index for r in after.relocations(buffer) if r.kind == SEGMENT} == {999}


def test_engine_allocations_win_over_the_segments_that_hold_them():
    kv = Region(ALLOC, 9, 0x7F00_0000_0000, 0x1000)
    segment = Region(SEGMENT, 0, 0x7F00_0000_0000, 0x2000)
    index = RegionIndex([segment, kv])
    assert index.resolve(0x7F00_0000_0010) == (kv, 0x10)
    assert index.resolve(0x7F00_0000_1010) == (segment, 0x1010)
    assert index.resolve(0x7F00_0000_2010) is None


def test_a_different_allocation_sequence_is_refused():
    graph_set, _ = GraphSet.load(FIXTURE)

    class Runner:
        class allocator:
            log = [Allocation(i, name, nbytes, 0) for i, (name, nbytes) in enumerate(graph_set.allocations)]

    assert allocation_mismatch(graph_set, Runner) is None
    Runner.allocator.log[-1] = Allocation(len(Runner.allocator.log) - 1, "kv_cache", 1234, 0)
    reason = allocation_mismatch(graph_set, Runner)
    assert reason and "kv_cache" in reason


def test_kernel_triggering_covers_every_kernel_with_fewer_sizes():
    graph_set, _ = GraphSet.load(FIXTURE)
    # a third graph that needs one kernel no other graph has: the cover must take it too
    odd = KernelNode(**{**graph_set.graphs[0].nodes[0].__dict__, "name": "only_in_batch_8"})
    graphs = graph_set.graphs + [type(graph_set.graphs[0])(8, [odd])]
    chosen = trigger_batch_sizes(graphs)
    used = {n.name for g in graphs if g.batch_size in chosen for n in g.nodes if isinstance(n, KernelNode)}
    assert used == set(graph_set.kernel_names) | {"only_in_batch_8"}
    assert 8 in chosen and len(chosen) < len(graphs)
