"""Turns each sequence's next-token logits into a token: penalties (runtime/engine/penalties.py), logit bias,
min_tokens and grammars (runtime/engine/constraints.py), greedy or temperature / top-k / top-p / min-p
sampling with a per-request seed, and the log-probabilities the request asked for.

Two halves, so the engine can launch the next step before it reads this one's tokens (async scheduling,
runtime/engine/llm_engine.py): `Sampler.__call__` queues the sampling on the device and starts copying the
results to the host; `SampledBatch.read()` waits for that copy and returns the tokens.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from runtime.engine.constraints import Constraints, constrained
from runtime.engine.penalties import Penalties, penalised
from runtime.engine.sampling_params import SamplingParams
from runtime.engine.sequence import Sequence


@dataclass
class SampledToken:
    token_id: int
    logprob: float | None = None
    top: list[tuple[int, float]] | None = None   # (token id, logprob), most likely first


class SampledBatch:
    """One step's sampled tokens: on the device at once (`tokens`, which the next step may read as its
    input), on the host after `read()`."""

    def __init__(self, tokens: torch.Tensor, seqs: list[Sequence], chosen: torch.Tensor | None = None,
                 top: tuple[torch.Tensor, torch.Tensor] | None = None) -> None:
        self.tokens = tokens
        self._wanted = [s.params.logprobs for s in seqs]
        # non_blocking copies to the host land in pinned memory; the event says when they have
        self._host = [t.to("cpu", non_blocking=True) if t is not None else None for t in (tokens, chosen)]
        self._host_top = [t.to("cpu", non_blocking=True) for t in top] if top is not None else None
        self._copied = None
        if tokens.is_cuda:
            self._copied = torch.cuda.Event()
            self._copied.record()

    def read(self) -> list[SampledToken]:
        if self._copied is not None:
            self._copied.synchronize()
        tokens, chosen = self._host
        results = [SampledToken(t) for t in tokens.tolist()]
        if chosen is None:
            return results
        chosen_list = chosen.tolist()
        top_values, top_ids = self._host_top if self._host_top is not None else (None, None)
        for i, n in enumerate(self._wanted):
            if n is None:
                continue
            results[i].logprob = chosen_list[i]
            if n:
                results[i].top = list(zip(top_ids[i, :n].tolist(), top_values[i, :n].tolist()))
        return results


class Sampler:
    def __init__(self, device: torch.device, seed: int, eos_token_ids: set[int] = frozenset()) -> None:
        self.device = device
        self.generator = torch.Generator(device=device).manual_seed(seed)
        self._request_generators: dict[str, torch.Generator] = {}
        self.penalties = Penalties(device)
        self.constraints = Constraints(device, eos_token_ids)

    def forget(self, request_id: str) -> None:
        self._request_generators.pop(request_id, None)
        self.penalties.forget(request_id)

    @torch.inference_mode()
    def __call__(self, logits: torch.Tensor, seqs: list[Sequence]) -> SampledBatch:
        if all(_plain_greedy(s.params) for s in seqs):
            # The argmax of bf16/fp16 logits is that of their (exact) fp32 values, first maximum on ties in
            # both: no fp32 copy of the [B, vocab] logits, one kernel and one transfer.
            return SampledBatch(logits.argmax(dim=-1), seqs)
        if logits.is_cuda and all(_greedy_logprob(s.params) for s in seqs):
            from runtime.engine.kernels.sampling import greedy_with_logprob  # Triton: never on a CPU start

            # the chosen token is the most likely one: its log-probability is also the top one, when asked
            tokens, chosen = greedy_with_logprob(logits)
            top = (chosen[:, None], tokens[:, None]) if any(s.params.logprobs for s in seqs) else None
            return SampledBatch(tokens, seqs, chosen, top)
        logits = logits.float()
        logprobs = torch.log_softmax(logits, dim=-1) if any(s.params.logprobs is not None for s in seqs) else None
        self.penalties.apply(logits, seqs)
        if any(constrained(s.params) for s in seqs):
            self.constraints.apply(logits, seqs)
        sampled_rows = [i for i, s in enumerate(seqs) if not s.params.greedy]
        if len(sampled_rows) == len(seqs):  # no argmax to overwrite, no rows to pick: fewer kernels to load
            tokens = self._sample(logits, seqs)
        else:
            tokens = logits.argmax(dim=-1)
            if sampled_rows:
                rows = torch.tensor(sampled_rows, device=logits.device)
                tokens[rows] = self._sample(logits[rows], [seqs[i] for i in sampled_rows])
        self.penalties.record(tokens, seqs)
        if logprobs is None:
            return SampledBatch(tokens, seqs)
        chosen = logprobs.gather(1, tokens[:, None]).squeeze(1)
        most = max(s.params.logprobs or 0 for s in seqs)
        return SampledBatch(tokens, seqs, chosen, _most_likely(logprobs, most) if most else None)

    def _sample(self, logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
        temps = torch.tensor([s.params.temperature or 1.0 for s in seqs], device=logits.device)
        logits = logits / temps[:, None]
        top_k = [s.params.top_k if s.params.top_k > 0 else 0 for s in seqs]
        top_p = [s.params.top_p for s in seqs]
        if any(top_k) or any(p < 1.0 for p in top_p):
            logits = _mask_top_k_top_p(logits, top_k, top_p)
        probs = torch.softmax(logits, dim=-1)
        if any(s.params.min_p for s in seqs):
            min_p = torch.tensor([s.params.min_p for s in seqs], device=logits.device)[:, None]
            probs = probs.masked_fill(probs < min_p * probs.max(dim=-1, keepdim=True).values, 0.0)
        # Sampling by the exponential race (argmax of p / Exp(1)) lets each request draw its noise from its
        # own seeded generator, so a seeded request gets the same tokens whatever else shares its batch.
        noise = torch.empty_like(probs)
        for i, seq in enumerate(seqs):
            noise[i].exponential_(generator=self._generator_for(seq))
        return (probs / noise).argmax(dim=-1)

    def _generator_for(self, seq: Sequence) -> torch.Generator:
        if seq.params.seed is None:
            return self.generator
        gen = self._request_generators.get(seq.request_id)
        if gen is None:
            gen = torch.Generator(device=self.device).manual_seed(seq.params.seed)
            self._request_generators[seq.request_id] = gen
        return gen


def _most_likely(logprobs: torch.Tensor, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The N largest log-probabilities of each row and their token ids, largest first. One is a max, not a
    top-k: on the GPU, top-k's kernel modules are large, and a process's first request loads them (on the
    H100, asking for the top log-probabilities cost a first request 44 ms, the chosen token's alone 12 ms:
    runtime/engine/warm_up.py)."""
    return logprobs.max(dim=-1, keepdim=True) if n == 1 else logprobs.topk(n, dim=-1)


def _greedy_unchanged(params: SamplingParams) -> bool:
    """Greedy on the logits as the model gave them (no penalties, bias or grammar)."""
    return params.greedy and not penalised(params) and not constrained(params)


def _plain_greedy(params: SamplingParams) -> bool:
    """Greedy on unchanged logits, and nothing else reads them (no logprobs)."""
    return _greedy_unchanged(params) and params.logprobs is None


def _greedy_logprob(params: SamplingParams) -> bool:
    """Greedy on unchanged logits, asking at most the chosen token's log-probability and the top one (what
    `greedy_with_logprob` gives: runtime/engine/kernels/sampling.py)."""
    return _greedy_unchanged(params) and (params.logprobs or 0) <= 1


def _mask_top_k_top_p(logits: torch.Tensor, top_k: list[int], top_p: list[float]) -> torch.Tensor:
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    vocab = logits.shape[-1]
    ranks = torch.arange(vocab, device=logits.device)[None, :]
    k = torch.tensor([kk or vocab for kk in top_k], device=logits.device)[:, None]
    drop = ranks >= k
    probs = torch.softmax(sorted_logits.masked_fill(drop, float("-inf")), dim=-1)
    before = probs.cumsum(dim=-1) - probs          # probability mass strictly above each token
    p = torch.tensor(top_p, device=logits.device)[:, None]
    drop |= before >= p                            # the most likely token is always kept (before == 0)
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.empty_like(logits).scatter_(1, order, sorted_logits)
