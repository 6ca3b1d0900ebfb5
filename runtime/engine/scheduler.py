"""Continuous batching: which sequences run in the next step, and with how many tokens each.

Every step, running sequences contribute the tokens they have not computed yet (one, while decoding),
and waiting sequences join as long as the token and sequence budgets and the free KV blocks allow:
prefills and decodes share a step. When a running sequence needs a block and none is free, the most
recently arrived running sequence is preempted: its blocks are freed and it goes back to the front of the
waiting queue, to be recomputed (prompt and the tokens it already generated) when blocks are free again.
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
    preempted: list[Sequence] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(self.num_new_tokens)

    @property
    def is_decode(self) -> bool:
        return all(n == 1 for n in self.num_new_tokens)


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
        self._schedule_running(batch)
        if not batch.preempted:
            self._admit_waiting(batch)
        return batch if batch.seqs else None

    def _schedule_running(self, batch: ScheduledBatch) -> None:
        queue = sorted(self.running, key=lambda s: s.arrival)
        while queue:
            seq = queue.pop(0)
            while not self.block_manager.can_grow(seq, seq.num_tokens):
                victim = queue.pop() if queue else seq
                self._preempt(victim)
                batch.preempted.append(victim)
                if victim is seq:
                    break
            else:
                self.block_manager.grow(seq, seq.num_tokens)
                batch.seqs.append(seq)
                batch.num_new_tokens.append(seq.num_uncomputed_tokens)

    def _admit_waiting(self, batch: ScheduledBatch) -> None:
        budget = self.max_num_batched_tokens - batch.num_tokens
        while self.waiting and len(batch.seqs) < self.max_num_seqs:
            seq = self.waiting[0]
            needed = seq.num_uncomputed_tokens
            if needed > budget or not self.block_manager.can_grow(seq, seq.num_tokens):
                break
            self.waiting.popleft()
            self.block_manager.grow(seq, seq.num_tokens)
            seq.status = Status.RUNNING
            self.running.append(seq)
            batch.seqs.append(seq)
            batch.num_new_tokens.append(needed)
            budget -= needed

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
