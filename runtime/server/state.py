"""What the app knows about the instance it serves for: one object, created before the engine exists.

The bootstrap starts listening with an empty state (every route but /health and /metrics answers 503),
runs a start path in the background and then fills the state in with `mark_ready()`. Handlers read the
engine only through `require_engine()`, which hands them the narrow EngineView (with several models, the
ModelView of the model a request names: runtime/server/models.py).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

from runtime import timeline as stages
from runtime.server.engine_view import EngineView
from runtime.server.errors import APIError, not_ready
from runtime.server.metrics import ServerMetrics
from runtime.start_paths import RESTORE_PATHS
from runtime.timeline import Timeline

if TYPE_CHECKING:  # the engine module imports torch; the server must not need it to start listening
    from runtime.engine import Engine
    from runtime.server.models import ModelView, ServedModels, StartedModels

Phase = Literal["starting", "ready", "draining", "failed"]

@dataclass(frozen=True)
class StartedEngine:
    """What a start path hands the server: the engine, the path that produced it, and why each faster
    path was skipped (path -> reason)."""

    engine: "Engine"
    restore_path: str
    skipped: dict[str, str] = field(default_factory=dict)
    #: the order the paths were tried in and what it rests on (runtime/start_paths.py: RestoreOrder.report)
    restore_order: dict[str, Any] = field(default_factory=dict)


@dataclass
class AppState:
    timeline: Timeline
    #: the name clients use; known from SERVED_MODEL_NAME before the engine is, else from the engine
    model_name: str | None = None
    #: several models (a MODEL list): their names, known from the start; model_name stays None
    model_names: list[str] = field(default_factory=list)
    phase: Phase = "starting"
    engine: EngineView | None = None
    #: several models: their views and the devices' slots, once started
    models: "ServedModels | None" = None
    #: which start path produced the engine, and why each faster one was not taken
    restore_path: str | None = None
    skipped: dict[str, str] = field(default_factory=dict)
    restore_order: dict[str, Any] = field(default_factory=dict)
    error: str | None = None
    ready_at: float | None = None
    metrics: ServerMetrics = field(init=False)

    def __post_init__(self) -> None:
        self.metrics = ServerMetrics(self)

    # Called on the event loop's thread: the state is read by request handlers without locks.
    def mark_ready(self, started: "StartedEngine | StartedModels") -> None:
        if started.restore_path not in RESTORE_PATHS:
            raise ValueError(f"unknown restore path {started.restore_path!r}")
        if not isinstance(started, StartedEngine):  # several models: their modules are imported only then
            from runtime.server.models import ServedModels

            self.models = ServedModels(started, self.metrics, self.timeline)
            self.model_names = self.models.names
        else:
            self.engine = EngineView(started.engine, self.metrics, self.timeline)
            self.model_name = self.model_name or started.engine.model_name
        self.restore_path = started.restore_path
        self.skipped = dict(started.skipped)
        self.restore_order = dict(started.restore_order)
        self.timeline.mark(stages.READY, restore_path=started.restore_path)
        self.ready_at = time.time()
        if self.phase == "starting":
            self.phase = "ready"

    def mark_failed(self, error: str) -> None:
        self.error = error
        self.phase = "failed"

    def begin_drain(self) -> None:
        """SIGTERM: /health turns 503 and new requests are refused; requests in flight carry on."""
        if self.phase != "failed":
            self.phase = "draining"

    def cut_requests(self, reason: str) -> None:
        """The drain's grace period is over: every request still in the engine ends with RequestCut."""
        if self.engine is not None:
            self.engine.cut_requests(reason)
        if self.models is not None:
            self.models.cut_requests(reason)

    @property
    def ready(self) -> bool:
        return self.phase == "ready"

    @property
    def served_names(self) -> list[str]:
        """Every model name clients may use."""
        return list(self.model_names) if self.model_names else [n for n in [self.model_name] if n]

    def require_engine(self, model: Any = None) -> "EngineView | ModelView":
        """The engine that serves a request naming `model`. With one model the name is checked where the
        request is parsed (handlers/openai_protocol.py), as it always was; with several it picks the model
        (400 when missing, 404 when unknown)."""
        if self.phase == "ready" and self.models is not None:
            return self.models.view(model)
        if self.phase == "ready" and self.engine is not None:
            return self.engine
        if self.phase == "draining":
            raise not_ready("the server is shutting down")
        if self.phase == "failed":
            raise APIError(503, f"the engine failed to start: {self.error}", code="engine_failed")
        raise not_ready("the model is still loading")
