"""Replay every decode graph on fixed inputs and fingerprint its output, to compare graphs bit for bit
(captured against restored, in different processes)."""

from __future__ import annotations

import hashlib

import torch

from runtime.engine.model_runner import ModelRunner

CONTEXT = 40      # tokens already in each probed sequence's cache
BLOCKS_PER_SEQ = 3


def blocks_needed(runner: ModelRunner) -> int:
    """The KV blocks (from the first) the probe uses when every one of them is backed."""
    return runner.reserved_blocks + max(runner.graph_batch_sizes) * BLOCKS_PER_SEQ


@torch.inference_mode()
def probe_graphs(runner: ModelRunner, seed: int = 0, usable_blocks: int | None = None) -> dict[int, str]:
    """batch size -> sha256 of the logits its graph produces from the same KV contents and inputs.
    USABLE_BLOCKS: how many blocks past the reserved ones are backed (a pooled KV cache backs them on
    demand); None: all of them. The bake and its check must pass the same number."""
    bs_max = max(runner.graphs)
    usable = runner.num_kv_blocks - runner.reserved_blocks
    if usable_blocks is not None:
        usable = min(usable, usable_blocks)
    tables = [[runner.reserved_blocks + (i * BLOCKS_PER_SEQ + j) % usable for j in range(BLOCKS_PER_SEQ)]
              for i in range(bs_max)]
    _fill_kv(runner, sorted({b for row in tables for b in row}), seed)
    d, block_size, vocab = runner.decode, runner.config.block_size, runner.model_config.vocab_size
    digests = {}
    for bs in sorted(runner.graphs):
        positions = [CONTEXT + i % 3 for i in range(bs)]
        d.input_ids[:bs].copy_(torch.tensor([(i * 37 + 11) % vocab for i in range(bs)]))
        d.positions[:bs].copy_(torch.tensor(positions))
        d.slot_mapping[:bs].copy_(torch.tensor([tables[i][p // block_size] * block_size + p % block_size
                                                for i, p in enumerate(positions)]))
        d.seq_lens[:bs].copy_(torch.tensor([p + 1 for p in positions], dtype=torch.int32))
        d.block_tables[:bs].zero_()
        d.block_tables[:bs, :BLOCKS_PER_SEQ].copy_(torch.tensor(tables[:bs], dtype=torch.int32))
        runner.graphs[bs].replay()
        torch.cuda.synchronize()
        digests[bs] = hashlib.sha256(d.logits[:bs].cpu().view(torch.uint8).numpy().tobytes()).hexdigest()
    return digests


def _fill_kv(runner: ModelRunner, blocks: list[int], seed: int) -> None:
    generator = torch.Generator(device=runner.device).manual_seed(seed)
    index = torch.tensor(blocks, device=runner.device)
    for k, v in runner.kv_caches:
        for cache in (k, v):
            values = torch.randn((len(blocks),) + tuple(cache.shape[1:]), generator=generator,
                                 device=runner.device, dtype=torch.float32)
            cache.index_copy_(0, index, values.to(cache.dtype))
