"""The Triton kernel of runtime/weights/device_checksum.py: each program adds up fmix64((i << 32) | w_i) over a
strided share of one chunk's 32-bit words; the host adds the PARTS partial sums of a chunk."""

import triton
import triton.language as tl


@triton.jit
def fmix64(x):
    x ^= x >> 33
    x *= 0xFF51AFD7ED558CCD
    x ^= x >> 33
    x *= 0xC4CEB9FE1A85EC53
    x ^= x >> 33
    return x


@triton.jit
def chunk_sums(data_ptr, starts_ptr, lengths_ptr, out_ptr, PARTS: tl.constexpr, BLOCK: tl.constexpr):
    chunk = tl.program_id(0)
    part = tl.program_id(1)
    start = tl.load(starts_ptr + chunk)  # bytes; a multiple of 4
    length = tl.load(lengths_ptr + chunk)
    n_words = length // 4
    words = (data_ptr + start).to(tl.pointer_type(tl.int32))
    acc = tl.zeros([BLOCK], dtype=tl.uint64)
    for first in range(part * BLOCK, n_words, PARTS * BLOCK):
        i = first + tl.arange(0, BLOCK).to(tl.int64)
        valid = i < n_words
        w = tl.load(words + i, mask=valid, other=0).to(tl.uint32, bitcast=True).to(tl.uint64)
        mixed = fmix64((i.to(tl.uint64) << 32) | w)
        acc += tl.where(valid, mixed, tl.zeros_like(mixed))
    total = tl.sum(acc, axis=0)
    # the last, partial word (zero-padded) is counted once, by part 0
    k = tl.arange(0, 4)
    tail = length - n_words * 4
    b = tl.load(data_ptr + start + n_words * 4 + k, mask=(k < tail) & (part == 0), other=0).to(tl.uint64)
    last = tl.sum(b << (8 * k).to(tl.uint64), axis=0)
    extra = fmix64((n_words.to(tl.uint64) << 32) | last)
    total += extra * ((tail > 0) & (part == 0)).to(tl.uint64)
    tl.store(out_ptr + chunk * PARTS + part, total)
