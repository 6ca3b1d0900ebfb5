"""The decode graphs read exactly the current batch's inputs, padded, whatever earlier steps staged: host
staging buffers are reused from step to step and rewritten only where they change."""

import random

import torch

from runtime.engine.decode_inputs import DecodeBuffers, DecodeStaging

MAX_BS, MAX_BLOCKS = 8, 6


def decode_buffers() -> DecodeBuffers:
    def garbage(shape, dtype):  # what a graph would read from rows nobody wrote
        return torch.full(shape, -7, dtype=dtype)

    return DecodeBuffers(garbage((MAX_BS,), torch.int64), garbage((MAX_BS,), torch.int64),
                         garbage((MAX_BS,), torch.int64), garbage((MAX_BS,), torch.int32),
                         garbage((MAX_BS, MAX_BLOCKS), torch.int32), torch.arange(MAX_BS + 1, dtype=torch.int32),
                         torch.zeros((MAX_BS, 4)))


def padded(values: list[int], bs: int, pad: int) -> list[int]:
    return values + [pad] * (bs - len(values))


def test_staged_decode_inputs_are_the_batch_padded_whatever_was_staged_before():
    rng = random.Random(0)
    decode = decode_buffers()
    staging = DecodeStaging(decode)
    running: list[dict] = []  # sequences: a length and a block table that grows in place
    for step in range(300):
        if running and rng.random() < 0.15:
            running.pop(rng.randrange(len(running)))                  # finished: the rows below move up
        if len(running) < MAX_BS and rng.random() < 0.3:
            running.insert(rng.randrange(len(running) + 1), {"len": 1, "table": [rng.randrange(100)]})
        if running and rng.random() < 0.1:                            # preempted and back: a new, shorter table
            seq = rng.choice(running)
            seq["len"], seq["table"] = 1, [rng.randrange(100)]
        for seq in running:
            seq["len"] += 1
            if seq["len"] > 4 * len(seq["table"]) and len(seq["table"]) < MAX_BLOCKS:
                seq["table"].append(rng.randrange(100))
        if not running:
            continue
        # a sequence's prompt tokens after a cached prefix are rows of their own that share its table
        rows = [seq for seq in running for _ in range(rng.choice((1, 1, 1, 2, 3)))][:MAX_BS]
        bs = next(b for b in (1, 2, 4, 8) if b >= len(rows))
        ids = [rng.randrange(500) for _ in rows]
        positions = [seq["len"] - 1 for seq in rows]
        slots = [rng.randrange(1000) for _ in rows]
        staging.fill(bs, ids, positions, slots, [seq["table"] for seq in rows])
        staging.upload(bs)

        assert decode.input_ids[:bs].tolist() == padded(ids, bs, 0), step
        assert decode.positions[:bs].tolist() == padded(positions, bs, 0), step
        assert decode.slot_mapping[:bs].tolist() == padded(slots, bs, 0), step
        assert decode.seq_lens[:bs].tolist() == padded([p + 1 for p in positions], bs, 1), step
        tables = padded([seq["table"] for seq in rows], bs, [])
        assert decode.block_tables[:bs].tolist() == [padded(t, MAX_BLOCKS, 0) for t in tables], step
