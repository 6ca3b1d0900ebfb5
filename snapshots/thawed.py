"""What a process restored from a snapshot knows about itself: set once, right after the handoff, and read
by the restore paths (snapshots/restore.py) when the bootstrap runs again inside the restored process."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from snapshots.handoff import Handoff

if TYPE_CHECKING:
    from runtime.engine import Engine
    from runtime.multi_model import BuiltModels
    from runtime.engine.llm_engine import WeightHandover


@dataclass
class Thawed:
    kind: str  # "process": built, not started; "gpu": started, with its device state restored
    engine: "Engine | None"  # None for several models (below)
    handoff: Handoff
    taken_over_at: float
    weights: "WeightReload | None" = None  # gpu, weights left out of the image: coming back since the restore
    handover: "WeightHandover | None" = None  # process: the weights the helper streamed during the restore
    models: "BuiltModels | None" = None  # process, several models: every model's engines, built, not started


class WeightReload(Protocol):
    """The weights of a weight-less gpu image on their way back: streamed by the restored process after the
    restore (snapshots/frozen.py) or during it by the CUDA restore helper (snapshots/weights_during_restore.py)."""

    def wait(self) -> tuple[float, dict]:
        """Block until they are in; returns (time.time() they started arriving, the timeline's detail)."""
        ...


#: None in every process but one restored from a snapshot
current: Thawed | None = None
