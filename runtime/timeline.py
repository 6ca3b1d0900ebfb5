"""The cold-start timeline: one object that times every stage from process spawn to first token.

Times are wall-clock seconds (time.time()) so that a parent process, a benchmark harness and a process
restored by CRIU all agree on them. Stages may overlap (weights stream while graphs are restored) and may
be recorded from any thread.
"""

from __future__ import annotations

import os
import resource
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Iterator

RUNTIME_INIT = "runtime_init"
RESTORE = "restore"
SNAPSHOT_VERIFY = "snapshot_verify"  # a snapshot's files checked against their baked digests
MODEL_SOURCE = "model_source"  # finding the model: a GGUF import on first use, an S3 layout's manifest
TOKENIZER = "tokenizer"
MODEL_STRUCTURE = "model_structure"
KERNEL_PREP = "kernel_prep"  # Triton and the driver bindings imported, Triton's keys computed, before CUDA
CUDA_INIT = "cuda_init"
WEIGHTS = "weights"
KV_CACHE = "kv_cache"
CUDA_GRAPHS = "cuda_graphs"
READY = "ready"
GRAPHS_AFTER_READY = "graphs_after_ready"  # materialised graphs of larger batch sizes, built while serving
EMBEDDING_AFTER_READY = "embedding_after_ready"  # the embedding table's rows a restore left for after ready
FIRST_TOKEN = "first_token"
MODEL_SWITCH = "model_switch"  # several models: the latest switch of a device to another model (runtime/pool)

#: the order stages are printed and drawn in
STAGE_ORDER = (RUNTIME_INIT, RESTORE, SNAPSHOT_VERIFY, MODEL_SOURCE, TOKENIZER, MODEL_STRUCTURE, KERNEL_PREP,
               CUDA_INIT, WEIGHTS, KV_CACHE, CUDA_GRAPHS, READY, GRAPHS_AFTER_READY, EMBEDDING_AFTER_READY,
               MODEL_SWITCH, FIRST_TOKEN)


@dataclass
class Stage:
    name: str
    start: float
    end: float | None = None
    detail: dict[str, Any] = field(default_factory=dict)

    @property
    def seconds(self) -> float:
        return (self.end if self.end is not None else time.time()) - self.start


@contextmanager
def thread_usage(detail: dict[str, Any], prefix: str) -> Iterator[None]:
    """Add to DETAIL what the calling thread did inside the block: PREFIX_cpu_s (user and system time, page
    faults included), PREFIX_system_s (of it, in the kernel), PREFIX_faults (minor page faults),
    PREFIX_disk_faults (page faults that waited for a read from storage), PREFIX_waits (times it blocked) and
    PREFIX_preempted (times the scheduler took the core away). Wall time well above the CPU time is time spent
    waiting; disk faults say whether some of it was spent on pages of files not in the page cache."""
    before = resource.getrusage(resource.RUSAGE_THREAD)
    try:
        yield
    finally:
        after = resource.getrusage(resource.RUSAGE_THREAD)
        detail[f"{prefix}_cpu_s"] = round(after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime, 4)
        detail[f"{prefix}_system_s"] = round(after.ru_stime - before.ru_stime, 4)
        detail[f"{prefix}_faults"] = after.ru_minflt - before.ru_minflt
        detail[f"{prefix}_disk_faults"] = after.ru_majflt - before.ru_majflt
        detail[f"{prefix}_waits"] = after.ru_nvcsw - before.ru_nvcsw
        detail[f"{prefix}_preempted"] = after.ru_nivcsw - before.ru_nivcsw


def process_start_time(pid: int | None = None) -> float:
    """Wall-clock time at which a process was spawned, from /proc (10 ms resolution)."""
    try:
        with open(f"/proc/{pid or 'self'}/stat", "rb") as f:
            fields = f.read().rsplit(b")", 1)[1].split()
        ticks = int(fields[19])  # field 22, counted after the ") " that ends the command name
        since_boot = time.clock_gettime(time.CLOCK_BOOTTIME) - ticks / os.sysconf("SC_CLK_TCK")
        return time.time() - since_boot
    except (OSError, ValueError, IndexError):
        return time.time()


class Timeline:
    def __init__(self, origin: float | None = None) -> None:
        self.origin = origin if origin is not None else _spawn_origin()
        self._stages: list[Stage] = []
        self._lock = threading.Lock()

    def record(self, name: str, start: float, end: float, replace: bool = False, **detail: Any) -> Stage:
        """A stage that ran from `start` to `end`; `replace` drops the earlier ones of that name (a stage
        that recurs while serving keeps only its latest)."""
        stage = Stage(name, start, end, dict(detail))
        with self._lock:
            if replace:
                self._stages = [s for s in self._stages if s.name != name]
            self._stages.append(stage)
        return stage

    @contextmanager
    def stage(self, name: str, **detail: Any) -> Iterator[Stage]:
        stage = Stage(name, time.time(), None, dict(detail))
        with self._lock:
            self._stages.append(stage)
        try:
            yield stage
        finally:
            stage.end = time.time()

    def mark(self, name: str, **detail: Any) -> Stage:
        """A stage that ends now and started where the previous stage of the timeline ended."""
        now = time.time()
        with self._lock:
            ends = [s.end for s in self._stages if s.end is not None]
        start = max(ends) if ends else self.origin
        return self.record(name, start, now, **detail)

    def stages(self) -> list[Stage]:
        with self._lock:
            return list(self._stages)

    def get(self, name: str) -> Stage | None:
        for stage in self.stages():
            if stage.name == name:
                return stage
        return None

    def latest(self, name: str, since: float = 0.0) -> Stage | None:
        """The last finished stage of that name that started at or after SINCE (several engines of one
        instance record into one timeline: a start reads its own stages this way)."""
        for stage in reversed(self.stages()):
            if stage.name == name and stage.start >= since and stage.end is not None:
                return stage
        return None

    def durations(self) -> dict[str, float]:
        """stage name -> seconds, summed when a stage was recorded more than once."""
        out: dict[str, float] = {}
        for stage in self.stages():
            if stage.end is not None:
                out[stage.name] = round(out.get(stage.name, 0.0) + stage.seconds, 6)
        return out

    def as_json(self) -> list[dict[str, Any]]:
        return [{"stage": s.name, "start_s": round(s.start - self.origin, 6),
                 "end_s": None if s.end is None else round(s.end - self.origin, 6),
                 "seconds": round(s.seconds, 6), **({"detail": s.detail} if s.detail else {})}
                for s in self.stages()]

    def format_table(self) -> str:
        rows = ["cold-start timeline (seconds since spawn)",
                f"  {'stage':<16} {'start':>8} {'end':>8} {'took':>8}  detail"]
        for s in sorted(self.stages(), key=lambda s: s.start):
            end = "-" if s.end is None else f"{s.end - self.origin:8.3f}"
            detail = " ".join(f"{k}={_short(v)}" for k, v in s.detail.items())
            rows.append(f"  {s.name:<16} {s.start - self.origin:8.3f} {end:>8} {s.seconds:8.3f}  {detail}")
        return "\n".join(rows)


def _spawn_origin() -> float:
    spawned = os.environ.get("THAWLLM_SPAWN_TIME")
    return float(spawned) if spawned else process_start_time()


def _short(value: Any) -> str:
    return f"{value:.3g}" if isinstance(value, float) else str(value)
