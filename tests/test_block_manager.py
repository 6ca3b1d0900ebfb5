"""The KV cache's bookkeeping: which blocks a sequence gets, and which a freed or given-back block becomes."""

from __future__ import annotations

from runtime.engine.block_manager import BlockManager
from runtime.engine.sampling_params import SamplingParams
from runtime.engine.sequence import Sequence

BLOCK = 4


def sequence(name: str, tokens: int, first: int = 1) -> Sequence:
    return Sequence(name, list(range(first, first + tokens)), SamplingParams())


def admitted(blocks: BlockManager, seq: Sequence) -> list[int]:
    blocks.admit(seq, [], seq.num_tokens)
    return list(seq.block_table)


def test_blocks_never_used_go_out_lowest_first_then_those_freed_in_the_order_they_came_back():
    blocks = BlockManager(8, BLOCK, reserved=1, prefix_caching=False)
    assert blocks.num_free == 7
    a, b = sequence("a", 3 * BLOCK), sequence("b", 2 * BLOCK)
    assert admitted(blocks, a) == [1, 2, 3]
    assert admitted(blocks, b) == [4, 5]
    blocks.free(a)  # the last block first: 3, 2, 1
    assert blocks.num_free == 2 + 3
    # the two never used come before any freed one, then the freed ones in the order they were freed
    assert admitted(blocks, sequence("c", 5 * BLOCK)) == [6, 7, 3, 2, 1]
    assert blocks.num_free == 0
    assert not blocks.can_admit([], 1)


def test_a_cache_given_back_above_a_block_never_hands_those_blocks_out_again():
    blocks = BlockManager(10, BLOCK, prefix_caching=False)
    a = sequence("a", 2 * BLOCK)
    assert admitted(blocks, a) == [0, 1]
    blocks.free(a)
    blocks.give_back(keep=4)
    assert blocks.num_free == 4
    assert sorted(admitted(blocks, sequence("b", 4 * BLOCK))) == [0, 1, 2, 3]
    assert not blocks.can_admit([], 1)


def test_blocks_granted_later_are_handed_out_once_the_first_ones_are_taken():
    class Capacity:
        def grant(self, usable: int, wanted: int) -> int:
            return usable + wanted

    blocks = BlockManager(6, BLOCK, reserved=1, capacity=Capacity(), prefix_caching=False)
    assert blocks.num_free == 0  # nothing backed until asked for
    assert admitted(blocks, sequence("a", 2 * BLOCK)) == [1, 2]
    assert admitted(blocks, sequence("b", 3 * BLOCK)) == [3, 4, 5]
    assert not blocks.can_admit([], 1)
