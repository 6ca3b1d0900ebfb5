"""What every CUDA graph capture in the process runs under.

Python's cyclic garbage collector runs in whichever thread happens to allocate when it triggers, and runs the
finalizers of everything it frees there: CUDA events, pinned buffers and device tensors left in cycles by an
earlier weight load or request. Run inside a capture, such a finalizer's CUDA call is made by the capturing
thread, which a capture forbids, and the capture is invalidated (`cudaErrorStreamCaptureInvalidated` at its
end). In a several-model instance this hit the third model's first start, captured while the garbage of the
second model's load was waiting to be collected. The collector is therefore paused for the capture."""

from __future__ import annotations

import contextlib
import gc
from typing import Iterator


@contextlib.contextmanager
def collection_paused() -> Iterator[None]:
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()
