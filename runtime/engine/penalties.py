"""Repetition, presence and frequency penalties, from per-request token statistics kept on the device.

The penalties depend on the tokens a request has so far. Read from the host, that history would lag one
step behind under async scheduling (runtime/engine/llm_engine.py): the last token is still on the device.
So each penalised request keeps, on the device, how often each token was generated and which tokens its
prompt or output holds, and every sampled token is added there on the device as it is sampled.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from runtime.engine.sampling_params import SamplingParams
from runtime.engine.sequence import Sequence


def penalised(params: SamplingParams) -> bool:
    return params.repetition_penalty != 1.0 or bool(params.presence_penalty or params.frequency_penalty)


@dataclass
class TokenCounts:
    generated: torch.Tensor  # [vocab] float32: times each token was generated
    seen: torch.Tensor       # [vocab] bool: in the prompt or generated


class Penalties:
    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._counts: dict[str, TokenCounts] = {}

    def forget(self, request_id: str) -> None:
        self._counts.pop(request_id, None)

    def apply(self, logits: torch.Tensor, seqs: list[Sequence]) -> None:
        """Penalise the float32 `logits` [B, vocab] in place, row i for seqs[i]."""
        for i, seq in enumerate(seqs):
            p = seq.params
            if not penalised(p):
                continue
            counts = self._counts_of(seq, logits.shape[1])
            row = logits[i]
            if p.repetition_penalty != 1.0:
                penalised_row = torch.where(row > 0, row / p.repetition_penalty, row * p.repetition_penalty)
                row.copy_(torch.where(counts.seen, penalised_row, row))
            if p.presence_penalty or p.frequency_penalty:
                row -= p.frequency_penalty * counts.generated + p.presence_penalty * (counts.generated > 0).float()

    def record(self, tokens: torch.Tensor, seqs: list[Sequence]) -> None:
        """Add the tokens just sampled ([B] on the device, tokens[i] for seqs[i]) to their requests' counts."""
        for i, seq in enumerate(seqs):
            counts = self._counts.get(seq.request_id)
            if counts is None:
                continue
            token = tokens[i:i + 1]
            counts.generated.index_add_(0, token, torch.ones(1, device=self.device))
            counts.seen.index_fill_(0, token, True)

    def _counts_of(self, seq: Sequence, vocab: int) -> TokenCounts:
        counts = self._counts.get(seq.request_id)
        if counts is None:  # at the request's first sampling, when everything it has is on the host
            generated = torch.zeros(vocab, device=self.device)
            if seq.output_ids:
                generated += torch.bincount(torch.tensor(seq.output_ids, device=self.device), minlength=vocab)[:vocab]
            seen = generated > 0
            seen[torch.tensor(seq.prompt_ids, device=self.device)] = True
            counts = self._counts[seq.request_id] = TokenCounts(generated, seen)
        return counts
