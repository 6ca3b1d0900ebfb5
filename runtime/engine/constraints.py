"""What a request forbids or favours before its next token is chosen: `logit_bias`, `min_tokens` (EOS and
`stop_token_ids` held back) and a grammar's token mask (runtime/engine/grammar.py).

They change the float32 logits of the rows that ask for them, after the penalties; a step whose requests
ask for none of them never comes here. A grammar's mask needs the request's previous token on the host,
so the engine does not run a step ahead of a request with a grammar (runtime/engine/llm_engine.py).
"""

from __future__ import annotations

import numpy as np
import torch

from runtime.engine.grammar import apply_masks, mask_words
from runtime.engine.sampling_params import SamplingParams
from runtime.engine.sequence import Sequence


def constrained(params: SamplingParams) -> bool:
    return bool(params.logit_bias or params.min_tokens or params.grammar)


class Constraints:
    def __init__(self, device: torch.device, eos_token_ids: set[int]) -> None:
        self.device = device
        self.eos_token_ids = sorted(eos_token_ids)

    def apply(self, logits: torch.Tensor, seqs: list[Sequence]) -> None:
        """Constrain `logits` [B, vocab] (float32) in place, row i for seqs[i]."""
        bias: tuple[list[int], list[int], list[float]] = ([], [], [])
        banned: tuple[list[int], list[int]] = ([], [])
        grammar_rows = []
        for i, seq in enumerate(seqs):
            p = seq.params
            for token, value in p.logit_bias.items():
                bias[0].append(i)
                bias[1].append(token)
                bias[2].append(value)
            if p.min_tokens and len(seq.output_ids) < p.min_tokens:
                for token in self._stop_ids(p):
                    banned[0].append(i)
                    banned[1].append(token)
            if seq.grammar is not None:
                grammar_rows.append(i)
        if bias[0]:
            rows, cols = self._upload(bias[0]), self._upload(bias[1])
            logits.index_put_((rows, cols), self._upload(bias[2], torch.float32), accumulate=True)
        if banned[0]:
            logits.index_put_((self._upload(banned[0]), self._upload(banned[1])),
                              torch.tensor(float("-inf"), device=logits.device))
        if grammar_rows:
            masks = np.zeros((len(grammar_rows), mask_words(logits.shape[1])), dtype=np.int32)
            for row, i in enumerate(grammar_rows):
                seq = seqs[i]  # a grammar's sequence never has a PENDING token (it does not run ahead)
                seq.grammar.fill_mask(masks, row, seq.params.max_tokens - len(seq.output_ids))
            apply_masks(logits, grammar_rows, torch.from_numpy(masks))

    def _stop_ids(self, params: SamplingParams) -> list[int]:
        return params.stop_token_ids + ([] if params.ignore_eos else self.eos_token_ids)

    def _upload(self, values: list, dtype: torch.dtype = torch.int64) -> torch.Tensor:
        return torch.tensor(values, dtype=dtype).to(self.device, non_blocking=True)
