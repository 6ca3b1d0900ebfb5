"""The paged KV cache's bookkeeping: which fixed-size blocks each sequence owns, and which blocks hold a
prefix that a new sequence may reuse.

Block ids index the KV cache tensors (runtime/engine/model_runner.py). Blocks are handed out as a
sequence grows and returned when it finishes, is aborted or is preempted.

Prefix caching: once every token of a full block is computed and known, the block is keyed by a hash of
its tokens chained to the hash of the block before it, so equal keys mean equal prefixes. A new sequence
claims the longest run of cached blocks that starts its tokens (reference-counted, shared with whoever else
holds them) and computes only the rest. Its last token is always computed, so its logits exist: a shared
block is full, and a sequence writes only past its computed tokens, so a shared block is never written.
Freed blocks keep their content and key until a block is needed and no empty one is left: then the least
recently freed cached block is evicted.

Under a multi-model pool (runtime/pool) the cache's memory comes on demand: only the blocks below
`usable` are backed, and when none of them is free (cached ones counted as free) the manager asks its
`KVCapacity` for more (the pool backs more of the cache, giving back retained weights of idle models if it
must); when it gets none, the scheduler preempts as it does with a fixed cache. `give_back(keep)` returns the
blocks of an idle engine from `keep` on, and forgets what they cached.
"""

from __future__ import annotations

from array import array
from collections import OrderedDict, deque
from typing import Iterable, Protocol

import xxhash

from runtime.engine.sequence import PENDING, Sequence


class KVCapacity(Protocol):
    def grant(self, usable: int, wanted: int) -> int:
        """Try to back WANTED more blocks than the USABLE first ones; returns how many first blocks are backed
        now (at least USABLE)."""


class _EmptyBlocks:
    """Free blocks that hold nothing reusable, taken in the order they became free: first the blocks never
    handed out, lowest first, kept as a range (a deque of every id of a large cache took 11-13 ms of each
    start: Qwen2-1.5B's cache on an H200 has 285,043 blocks), then those given back since."""

    def __init__(self, start: int, stop: int) -> None:
        self._next, self._stop = start, stop
        self._returned: deque[int] = deque()

    def __len__(self) -> int:
        return self._stop - self._next + len(self._returned)

    def take(self) -> int:
        if self._next < self._stop:
            self._next += 1
            return self._next - 1
        return self._returned.popleft()

    def put(self, block: int) -> None:
        self._returned.append(block)

    def put_all(self, blocks: Iterable[int]) -> None:
        self._returned.extend(blocks)

    def keep_below(self, keep: int) -> None:
        """Forget the blocks from KEEP on."""
        self._stop = max(self._next, min(self._stop, keep))
        self._returned = deque(b for b in self._returned if b < keep)


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, reserved: int = 0, capacity: KVCapacity | None = None,
                 prefix_caching: bool = True) -> None:
        # The first `reserved` blocks are never handed out: padded rows of a CUDA graph batch write there.
        self.block_size = block_size
        self.num_blocks = num_blocks - reserved
        self.prefix_caching = prefix_caching
        self._reserved = reserved
        self._capacity = capacity
        self._usable = num_blocks if capacity is None else reserved
        self._empty = _EmptyBlocks(reserved, self._usable)  # free, holding nothing reusable
        self._evictable: OrderedDict[int, None] = OrderedDict()       # free and cached, least recently freed first
        self._refs = [0] * num_blocks
        self._key_of: dict[int, int] = {}         # cached block -> its key
        self._block_of: dict[int, int] = {}       # key -> cached block
        self._tokens_of: dict[int, bytes] = {}    # cached block -> its tokens, checked on every hit
        self.query_tokens = 0   # tokens looked up in the prefix cache (every admission's whole sequence)
        self.hit_tokens = 0     # of which found there

    @property
    def num_free(self) -> int:
        return len(self._empty) + len(self._evictable)

    @property
    def num_used(self) -> int:
        return self._usable - self._reserved - self.num_free

    @property
    def num_cached(self) -> int:
        return len(self._block_of)

    # -- prefix cache ------------------------------------------------------------------------------

    def cached_prefix(self, seq: Sequence) -> list[int]:
        """The longest run of cached blocks that starts `seq`'s tokens, in order; nothing is claimed."""
        if not self.prefix_caching:
            return []
        tokens = _packed(seq.token_ids())
        found: list[int] = []
        key = None
        for i in range((seq.num_tokens - 1) // self.block_size):  # the last token is always computed
            chunk = self._chunk(tokens, i)
            key = _key(key, chunk)
            block = self._block_of.get(key)
            if block is None or self._tokens_of[block] != chunk:
                break
            found.append(block)
        return found

    def can_admit(self, cached: list[int], num_tokens: int) -> bool:
        """Whether a sequence that claims `cached` has room for `num_tokens` tokens."""
        needed = -(-num_tokens // self.block_size) - len(cached)
        return self._have_free(needed + sum(1 for b in cached if self._refs[b] == 0))

    def admit(self, seq: Sequence, cached: list[int], num_tokens: int) -> None:
        """Give `seq` (holding no blocks) the `cached` prefix, counted as computed, and room for `num_tokens`."""
        for block in cached:
            if self._refs[block] == 0:
                del self._evictable[block]
            self._refs[block] += 1
        seq.block_table.extend(cached)
        seq.block_keys = [self._key_of[b] for b in cached]
        seq.num_computed_tokens = len(cached) * self.block_size
        if not seq.output_ids:
            seq.num_cached_tokens = seq.num_computed_tokens
        if self.prefix_caching:
            self.query_tokens += seq.num_tokens
            self.hit_tokens += seq.num_computed_tokens
        self.grow(seq, num_tokens)

    def cache_blocks(self, seq: Sequence) -> None:
        """Key `seq`'s blocks that have become full of computed, known tokens, so others may reuse them."""
        known = seq.num_tokens - (1 if seq.output_ids and seq.output_ids[-1] == PENDING else 0)
        full = min(seq.num_computed_tokens, known) // self.block_size
        done = len(seq.block_keys)
        if not self.prefix_caching or full <= done:
            return
        tokens = _packed(seq.tokens_between(done * self.block_size, full * self.block_size))
        key = seq.block_keys[-1] if done else None
        for i in range(done, full):
            chunk = self._chunk(tokens, i - done)
            key = _key(key, chunk)
            seq.block_keys.append(key)
            block = seq.block_table[i]
            if key not in self._block_of:  # an equal block cached before stays the one found
                self._block_of[key], self._key_of[block], self._tokens_of[block] = block, key, chunk

    def give_back(self, keep: int = 0) -> None:
        """Stop using every block from KEEP on (their memory is about to be given back): only when none is
        held. What the blocks below KEEP cache stays cached."""
        if self.num_used:
            raise RuntimeError(f"{self.num_used} KV blocks are still held")
        keep = min(max(keep, self._reserved), self._usable)
        for block in [b for b in self._evictable if b >= keep]:
            del self._evictable[block]
            del self._block_of[self._key_of.pop(block)]
            del self._tokens_of[block]
        self._empty.keep_below(keep)
        self._usable = keep

    def reset_prefix_cache(self) -> None:
        """Forget every cached prefix (the blocks held stay held)."""
        self._empty.put_all(self._evictable)
        self._evictable.clear()
        self._block_of.clear()
        self._key_of.clear()
        self._tokens_of.clear()

    # -- growth and release ------------------------------------------------------------------------

    def blocks_needed(self, seq: Sequence, num_tokens: int) -> int:
        """Blocks to add so that `num_tokens` tokens of `seq` have a slot."""
        return max(0, -(-num_tokens // self.block_size) - len(seq.block_table))

    def _have_free(self, needed: int) -> bool:
        if needed > self.num_free and self._capacity is not None:
            usable = self._capacity.grant(self._usable, needed - self.num_free)
            usable = min(usable, self.num_blocks + self._reserved)
            self._empty.put_all(range(self._usable, usable))
            self._usable = max(self._usable, usable)
        return needed <= self.num_free

    def can_grow(self, seq: Sequence, num_tokens: int) -> bool:
        return self._have_free(self.blocks_needed(seq, num_tokens))

    def grow(self, seq: Sequence, num_tokens: int) -> None:
        needed = self.blocks_needed(seq, num_tokens)
        if not self._have_free(needed):
            raise RuntimeError("out of KV blocks (the scheduler should have preempted)")
        seq.block_table.extend(self._take() for _ in range(needed))

    def _take(self) -> int:
        if self._empty:
            block = self._empty.take()
        else:
            block, _ = self._evictable.popitem(last=False)
            del self._block_of[self._key_of.pop(block)]
            del self._tokens_of[block]
        self._refs[block] = 1
        return block

    def free(self, seq: Sequence) -> None:
        self.cache_blocks(seq)
        # last block first, so that a sequence's tail is evicted before the prefix others may share
        for block in reversed(seq.block_table):
            self._refs[block] -= 1
            if self._refs[block] == 0:
                if block in self._key_of:
                    self._evictable[block] = None
                else:
                    self._empty.put(block)
        seq.block_table = []
        seq.block_keys = []
        seq.num_computed_tokens = 0

    def slot(self, seq: Sequence, position: int) -> int:
        """The flat KV-cache slot of token `position` of `seq`."""
        return seq.block_table[position // self.block_size] * self.block_size + position % self.block_size

    def _chunk(self, tokens: bytes, i: int) -> bytes:
        width = self.block_size * 4
        return tokens[i * width:(i + 1) * width]


def _packed(token_ids: list[int]) -> bytes:
    return array("i", token_ids).tobytes()


def _key(parent: int | None, chunk: bytes) -> int:
    # one call over the parent's digest and the chunk: the same key as feeding both to a hasher in turn,
    # without making a hasher per block (a long prompt's lookup runs on the host before its step)
    return xxhash.xxh3_128_intdigest(chunk if parent is None else parent.to_bytes(16, "little") + chunk)
