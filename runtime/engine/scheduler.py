"""Continuous batching: which sequences run in the next step, and with how many tokens each.

Every step has a token budget (`max_num_batched_tokens`) and a sequence budget (`max_num_seqs`). Running
sequences that decode take one token each first; then prompts part-way through their prefill, then waiting
sequences, take slices of what is left (chunked prefill): a long prompt is computed over several steps, each
attending to the slices before it, so decodes keep their pace while it is prefilled. A waiting sequence
starts from the longest cached prefix of its tokens (prefix caching, runtime/engine/block_manager.py).
When a running sequence needs a block and none is free, the most recently arrived running sequence is
preempted: its blocks are freed and it goes back to the front of the waiting queue, to be recomputed
(prompt and the tokens it already generated, reusing whatever of it is still cached) when blocks are free.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from runtime.engine.block_manager import BlockManager
from runtime.engine.sequence import Sequence, Status


@dataclass
class ScheduledBatch:
    seqs: list[Sequence]
    num_new_tokens: list[int]
    # per sequence: whether this step reaches its last token, so that a next token is sampled
    samples: list[bool] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)

    def add(self, seq: Sequence, num_tokens: int) -> None:
        self.seqs.append(seq)
        self.num_new_tokens.append(num_tokens)
        self.samples.append(num_tokens == seq.num_uncomputed_tokens)

    @property
    def num_tokens(self) -> int:
        return sum(self.num_new_tokens)

    @property
    def is_decode(self) -> bool:
        """One token per sequence, each its last (what a decode CUDA graph runs)."""
        return all(n == 1 for n in self.num_new_tokens) and all(self.samples)

    @property
    def continues_every_prompt(self) -> bool:
        """No sequence starts its prompt in this step: each one's new tokens follow tokens already computed
        (cached, or an earlier slice's). A step in a decode graph computes with other kernels than an eager
        one, so a prompt computed from its start stays eager: its first tokens come out the same whether or
        not the graphs of a materialised start have all been rebuilt yet."""
        return all(seq.num_computed_tokens > 0 for seq in self.seqs)

    @property
    def sampling_seqs(self) -> list[Sequence]:
        return [seq for seq, sample in zip(self.seqs, self.samples) if sample]


class Scheduler:
    def __init__(self, block_manager: BlockManager, max_num_seqs: int, max_num_batched_tokens: int) -> None:
        self.block_manager = block_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> ScheduledBatch | None:
        batch = ScheduledBatch([], [])
        budget = self._schedule_running(batch, self.max_num_batched_tokens)
        if not batch.preempted:
            self._admit_waiting(batch, budget)
        return batch if batch.seqs else None

    def _schedule_running(self, batch: ScheduledBatch, budget: int) -> int:
        blocks = self.block_manager
        # decodes first, then prompts part-way through their prefill; oldest first within each
        queue = sorted(self.running, key=lambda s: (s.num_uncomputed_tokens > 1, s.arrival))
        while queue and budget > 0:
            seq = queue.pop(0)
            blocks.cache_blocks(seq)
            n = min(seq.num_uncomputed_tokens, budget)
            while not blocks.can_grow(seq, seq.num_computed_tokens + n):
                victim = queue.pop() if queue else seq
                self._preempt(victim)
                batch.preempted.append(victim)
                if victim is seq:
                    break
            else:
                blocks.grow(seq, seq.num_computed_tokens + n)
                batch.add(seq, n)
                budget -= n
        return budget

    def _admit_waiting(self, batch: ScheduledBatch, budget: int) -> None:
        blocks = self.block_manager
        while self.waiting and len(self.running) < self.max_num_seqs and budget > 0:
            seq = self.waiting[0]
            cached = blocks.cached_prefix(seq)
            computed = len(cached) * blocks.block_size
            n = min(seq.num_tokens - computed, budget)
            if not blocks.can_admit(cached, computed + n):
                break
            self.waiting.popleft()
            blocks.admit(seq, cached, computed + n)
            seq.status = Status.RUNNING
            self.running.append(seq)
            batch.add(seq, n)
            budget -= n

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.block_manager.free(seq)
        seq.status = Status.WAITING
        self.waiting.appendleft(seq)

    def finish(self, seq: Sequence, reason: str) -> None:
        seq.status = Status.FINISHED
        seq.finish_reason = reason
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self.block_manager.free(seq)

    def find(self, request_id: str) -> Sequence | None:
        for seq in (*self.running, *self.waiting):
            if seq.request_id == request_id:
                return seq
        return None
