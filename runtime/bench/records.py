"""What a benchmark run produces: records that go to JSON, the tables and the plots."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

from runtime.timeline import STAGE_ORDER

#: the server's restore paths (in the fixed order auto uses without a measurement), and the outside baseline
SERVER_MODES = ("gpu", "process", "materialized", "cold")
BASELINE_MODE = "transformers"
#: how a several-model instance's first activation of a model loads its kernels (faas-bench switch's rows)
FIRST_KERNELS = ("beside", "after", "restored")
ALL_MODES = SERVER_MODES + (BASELINE_MODE,)
#: a restore path with one setting changed, to compare the two in one run (never run unless named):
#: gpu-after and process-after stream the weights after the restore instead of during it; process-during
#: streams them during it whether or not they are in the page cache; process-unprimed starts no driver primer;
#: gpu-late and process-late start CRIU after the bootstrap's imports and checks, not before them;
#: process-lazy hands over before criu has restored all of the memory (LAZY_PAGES=1); cold-unprefetched and
#: process-unprefetched leave the weights to whoever streams them (PREFETCH_WEIGHTS=0); process-unlisted and
#: gpu-unlisted leave the restored runtime's file pages to its faults (PREFETCH_START_PAGES=0);
#: process-wide-restore prefetches on all 16 threads while CRIU restores, not 4 (PREFETCH_RESTORE_READERS);
#: process-8-readers prefetches the weights on 8 threads rather than 16 (PREFETCH_READERS); process-memory-last
#: has the weights' helper hand its memory over only with the stream's report (WEIGHTS_MEMORY_FIRST=0);
#: process-site and cold-site start the entry point after `site`, as the `faas-bootstrap` script does (SITE_FIRST);
#: process-probing and gpu-probing leave criu to probe the kernel's features itself (CRIU_FEATURE_CACHE=0);
#: process-whole-table has the weights' helper stream the whole embedding table before serving (EMBEDDING_LAST=0);
#: process-table-16-readers reads the table last on all 16 threads of the prefetch, not 4 (PREFETCH_TABLE_READERS)
VARIANTS = {"process-site": ("process", {}),
            "cold-site": ("cold", {}),
            "process-lazy": ("process", {"LAZY_PAGES": "1"}),
            "process-unprefetched": ("process", {"PREFETCH_WEIGHTS": "0"}),
            "process-unlisted": ("process", {"PREFETCH_START_PAGES": "0"}),
            "process-wide-restore": ("process", {"PREFETCH_RESTORE_READERS": "16"}),
            "gpu-unlisted": ("gpu", {"PREFETCH_START_PAGES": "0"}),
            "process-8-readers": ("process", {"PREFETCH_READERS": "8"}),
            "process-memory-last": ("process", {"WEIGHTS_MEMORY_FIRST": "0"}),
            "cold-unprefetched": ("cold", {"PREFETCH_WEIGHTS": "0"}),
            "gpu-late": ("gpu", {"EARLY_RESTORE": "0"}),
            "process-late": ("process", {"EARLY_RESTORE": "0"}),
            "gpu-after": ("gpu", {"WEIGHTS_DURING_RESTORE": "0"}),
            "process-after": ("process", {"WEIGHTS_DURING_RESTORE": "0"}),
            "process-during": ("process", {"WEIGHTS_DURING_RESTORE": "1"}),
            "process-unprimed": ("process", {"PRIME_DRIVER": "0"}),
            "process-probing": ("process", {"CRIU_FEATURE_CACHE": "0"}),
            "gpu-probing": ("gpu", {"CRIU_FEATURE_CACHE": "0"}),
            "process-whole-table": ("process", {"EMBEDDING_LAST": "0"}),
            "process-table-16-readers": ("process", {"PREFETCH_TABLE_READERS": "16"})}
SITE_FIRST = ("process-site", "cold-site")


@dataclass
class StartRun:
    """One fresh process, from spawn to its first token. Times are seconds since the spawn."""

    mode: str
    restore_path: str
    spawn_to_ready_s: float
    spawn_to_first_token_s: float
    #: [{"stage", "start_s", "end_s", "seconds"}], the server's timeline (stages may overlap)
    stages: list[dict[str, Any]]
    prompt_tokens: int | None
    page_cache: str
    #: read from the machine's disks from the spawn until the process was stopped (runtime/bench/disk_read.py)
    disk_read_bytes: int | None = None
    #: of which until the first request's answer was complete: what the start itself read (a server's start)
    disk_read_to_answer_bytes: int | None = None
    #: from a dropped page cache, the fastest read of the model in this start's round (runtime/bench/disk_read.py)
    reference_read_s: float | None = None


@dataclass
class ModeResult:
    mode: str
    status: Literal["ok", "skipped", "failed"] = "ok"
    reason: str | None = None
    runs: list[StartRun] = field(default_factory=list)


def stages_from_durations(durations: dict[str, float]) -> list[dict[str, Any]]:
    """A timeline known only as stage -> seconds, laid end to end in STAGE_ORDER (no overlap known)."""
    order = sorted(durations, key=lambda s: STAGE_ORDER.index(s) if s in STAGE_ORDER else len(STAGE_ORDER))
    out, t = [], 0.0
    for name in order:
        out.append({"stage": name, "start_s": round(t, 6), "end_s": round(t + durations[name], 6),
                    "seconds": durations[name]})
        t += durations[name]
    return out
