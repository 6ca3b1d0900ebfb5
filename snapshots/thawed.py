"""What a process restored from a snapshot knows about itself: set once, right after the handoff, and read
by the restore paths (snapshots/restore.py) when the bootstrap runs again inside the restored process."""

from __future__ import annotations

from dataclasses import dataclass, field
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
    weights: object | None = None  # gpu, weights left out of the image: their load, streaming since restore
    reload: dict = field(default_factory=dict)  # when it started, how long mapping the memory back took


#: None in every process but one restored from a snapshot
current: Thawed | None = None
