"""Packed weights for the CPU's few-token projections: weights that are exactly 4-bit or 8-bit values in groups
of 32 (what a Q4_1 or Q8_0 GGUF imports as) are kept a second time in that form, and projections of up to 8
tokens (decode steps) read them through runtime/engine/cpu/packed_gemv.c instead of the float32 matrix.

Lossless by construction: a weight is packed only if every value unpacks to exactly its float32 value, so
the projection computes the same product as the float32 one, up to the order of its sums. Larger steps
(prompts) stay on torch's float32 matmul, which is bound by compute, not by the bytes of the weights.
"""

from __future__ import annotations

import ctypes
import functools
from dataclasses import dataclass

import torch

from runtime.logs import get_logger
from runtime.native_library import open_built

log = get_logger("engine.cpu")

GROUP = 32
#: most tokens a packed projection takes (decode steps of up to 8 sequences); more go to torch's matmul
MAX_TOKENS = 8
#: the version of packed_gemv.c's functions this module calls (its thaw_packed_abi)
ABI = 2


@dataclass(frozen=True)
class PackedWeight:
    bits: int              # 4 (w = d*q + m, q in 0..15) or 8 (w = d*q, q in -127..127)
    blocks: torch.Tensor   # uint8 [n, k / 32 * block bytes]: per group fp16 d (and m), then the q values
    n: int
    k: int

    @property
    def nbytes(self) -> int:
        return self.blocks.numel()


class PackedKernels:
    """The C kernels, loaded with ctypes (which releases the GIL for each call). They run on `threads`
    threads, torch's count when they were loaded (the engine sets it first): a decode step runs torch's own
    ops on one thread (runtime/engine/cpu/threads.py, `ops_on_one_thread`), not these."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        self.threads = torch.get_num_threads()
        # bytes of one group's block: fp16 d and m and 16 bytes of nibble pairs (4), fp16 d and 32 int8 (8)
        self.block_bytes = {bits: lib.thaw_block_bytes(bits) for bits in (4, 8)}
        self._gemv = lib.thaw_packed_gemv
        self._gemv.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_int, ctypes.c_int, ctypes.c_void_p,
                               ctypes.c_long, ctypes.c_void_p, ctypes.c_int]
        self._pack = lib.thaw_pack
        self._pack.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_long, ctypes.c_int, ctypes.c_void_p,
                               ctypes.c_int]

    def pack(self, weight: torch.Tensor) -> PackedWeight | None:
        """`weight` [n, k] float32 as 4-bit groups, else 8-bit groups, where that holds every value exactly."""
        n, k = weight.shape
        if weight.dtype != torch.float32 or k % GROUP or not weight.is_contiguous():
            return None
        for bits in (4, 8):
            blocks = torch.empty(n, k // GROUP * self.block_bytes[bits], dtype=torch.uint8)
            if self._pack(bits, weight.data_ptr(), n, k, blocks.data_ptr(), torch.get_num_threads()) == 0:
                return PackedWeight(bits, blocks, n, k)
        return None

    def gemv(self, x: torch.Tensor, w: PackedWeight, bias: torch.Tensor | None = None) -> torch.Tensor:
        """x [t, k] float32, t <= MAX_TOKENS -> [t, n]."""
        x = x.contiguous()
        tokens = x.shape[0]
        y = torch.empty(tokens, w.n)
        if self._gemv(w.bits, x.data_ptr(), tokens, w.k, w.blocks.data_ptr(), w.n, y.data_ptr(), self.threads):
            raise ValueError(f"packed projection of {tokens} tokens over a {w.bits}-bit [{w.n}, {w.k}] weight")
        return y if bias is None else y.add_(bias)


@functools.cache
def packed_kernels() -> PackedKernels | None:
    """The built kernels, or None (said once in the log, with the reason): projections then stay float32."""
    return _load()


def _load() -> PackedKernels | None:
    lib = open_built("runtime.engine.cpu._packed_gemv", "the packed CPU kernel", "weights stay float32", log)
    if lib is None:
        return None
    abi = getattr(lib, "thaw_packed_abi", None)
    if abi is None or abi() != ABI:
        log.warning("the packed CPU kernel was built from other sources (pip install -e . rebuilds it): weights "
                    "stay float32")
        return None
    if not lib.thaw_gemv_supported():
        log.info("this CPU lacks AVX2, FMA or F16C: weights stay float32")
        return None
    return PackedKernels(lib)
