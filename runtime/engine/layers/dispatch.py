"""Which implementation an op uses: the Triton kernels on cuda, the PyTorch references on cpu.

`kernels_on_cpu` exists for tests: with Triton's interpreter (TRITON_INTERPRET=1) the kernels run on cpu
tensors, so a whole model can be run through them on a machine without a GPU.
"""

from __future__ import annotations

import torch

kernels_on_cpu = False


def use_kernels(x: torch.Tensor) -> bool:
    return x.is_cuda or kernels_on_cpu
