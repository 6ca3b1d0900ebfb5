"""Host work started on a thread of its own, its result a Future: what a start can do while it waits for
something else (the CUDA context's creation, which leaves the GIL free most of its time)."""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor
from typing import Callable


def in_background(fn: Callable, *args, name: str) -> Future:
    """FN(*ARGS) on a new thread named NAME, started now."""
    pool = ThreadPoolExecutor(1, thread_name_prefix=name)
    try:
        return pool.submit(fn, *args)
    finally:
        pool.shutdown(wait=False)
