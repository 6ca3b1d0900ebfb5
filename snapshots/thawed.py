"""What a process restored from a snapshot knows about itself: set once, right after the handoff, and read
by the restore paths (snapshots/restore.py) when the bootstrap runs again inside the restored process."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from snapshots.handoff import Handoff

if TYPE_CHECKING:
    from runtime.engine import Engine


@dataclass
class Thawed:
    kind: str  # "process": built, not started; "gpu": started, with its device state restored
    engine: "Engine"
    handoff: Handoff
    taken_over_at: float
    weights: "WeightReload | None" = None  # gpu, weights left out of the image: streaming since the restore


@dataclass
class WeightReload:
    load: object     # the engine's WeightLoad (its wait() is the end)
    started: float   # time.time() when memory was mapped back
    remap_s: float   # how long mapping the released ranges again took


#: None in every process but one restored from a snapshot
current: Thawed | None = None
