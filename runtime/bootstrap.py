"""faas-bootstrap: the container's entry point.

settings (environment + flags) -> logging -> the app, listening before the engine exists (/health 503) ->
a start path chosen and run on a worker thread (`start_engine`) -> ready (the timeline printed) -> serve,
over HTTP for Knative or through the Lambda Runtime API when AWS_LAMBDA_RUNTIME_API is set.

Nothing on the way to listening imports torch: the engine module, the weights and the Lambda client are
imported by the paths that need them. Nothing imports this module.
"""

from __future__ import annotations

import gc
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Sequence

from runtime import timeline as stages
from runtime.config import ConfigError, Settings
from runtime.logs import get_logger, setup_logging
from runtime.start_paths import SkipPath, read_restore_order
from runtime.timeline import Timeline
from snapshots import early_restore, stop_during_restore

if TYPE_CHECKING:
    from runtime.engine import Engine
    from runtime.server.models import StartedModels
    from runtime.server.state import StartedEngine

log = get_logger("bootstrap")


def main(argv: Sequence[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if "-h" in argv or "--help" in argv:
        Settings.argument_parser("faas-bootstrap").print_help()
        return 0
    lambda_api = os.environ.get("AWS_LAMBDA_RUNTIME_API")
    try:
        settings = Settings.from_args(argv)
        for model in settings.models:
            check_model_ref(model.ref)
    except ConfigError as exc:
        early_restore.abandon()
        stop_during_restore.release()
        return _config_error(exc, lambda_api)
    setup_logging(settings.log_level)
    from runtime.weights import prefetch
    from snapshots import start_pages

    start_pages.log_start()
    prefetch.log_start()
    several = len(settings.models) > 1
    if settings.restore in ("auto", "gpu", "process"):
        # A CRIU snapshot that fits is restored as a child, before listening: it listens and serves, and
        # this process supervises it (with several models, the process snapshot of every model's engine).
        # Inside the restored process this returns None and main goes on.
        # No collections while the imports and checks race to criu (they took 5-8 ms of the way there on the
        # CPU machine). A start without a restore gets the collector back; a supervising bootstrap keeps it
        # off (it allocates next to nothing), and the restored runtime has its own.
        gc.disable()
        try:
            from snapshots.restore import take_over

            status = take_over(settings, argv)
        finally:
            gc.enable()
        if status is not None:
            return status
    prefetch.widen()  # no restore: the weights have the disk
    early_restore.abandon()  # one the entry point started: undone where this start restores nothing
    stopped = stop_during_restore.release()
    if stopped is not None:  # asked to stop while it looked or restored: nothing is left to stop but this process
        log.info("stopped by signal %d while the start looked for a snapshot or restored one: not starting fresh",
                 stopped)
        return 128 + stopped
    try:
        # After any restore: a bootstrap that restores a snapshot never needs the handler's imports
        # (starlette's alone take a tenth of a second), and the restored runtime has them already.
        from runtime.server.handler import load_handler

        handler = load_handler(settings.handler)
    except ConfigError as exc:
        return _config_error(exc, lambda_api)
    _route_uvicorn_logs()

    from handlers import health
    from runtime.server.app import build_app
    from runtime.server.state import AppState

    if several:
        state = AppState(Timeline(), model_names=[m.name for m in settings.models])
    else:
        state = AppState(Timeline(), model_name=served_model_name(settings))
    if settings.profile_start is not None:
        from runtime.start_profile import StartProfile

        try:
            StartProfile(settings.profile_start, state.timeline).start()
        except OSError as exc:  # a diagnostic: never what keeps the function from serving
            log.warning("PROFILE_START=%s: cannot write a profile there (%s); starting without one",
                        settings.profile_start, exc)
    app = build_app(state, [health.handler, handler], settings.api_key,
                    int(settings.max_request_mb * 2**20))

    def start() -> StartedEngine | StartedModels:
        if several:
            from runtime.multi_model import start_models

            return start_models(settings, state.timeline, build_fresh)
        return start_engine(settings, state.timeline)

    if lambda_api:
        from runtime.server.lambda_runtime import run_lambda

        return run_lambda(lambda_api, app, state, handler, settings.lambda_invoke_mode, start)
    from runtime.server.serve import serve_http

    return serve_http(app, state, settings, start)


# -- start paths ----------------------------------------------------------------------------------------

def start_engine(settings: Settings, timeline: Timeline) -> StartedEngine:
    """Choose and run a start path: the restore paths in the order faas-build measured fastest (else gpu,
    process, materialized), else cold. A path that is missing, mismatched or fails is skipped with its
    reason; the cold path always works."""
    from runtime.server.state import StartedEngine

    order = read_restore_order(settings.snapshot_dir)
    if settings.restore == "auto" and settings.snapshot_dir is not None:
        log.info("%s", order.summary())
    skipped: dict[str, str] = {}
    for name in order.paths:
        if settings.restore not in ("auto", name):
            skipped[name] = f"RESTORE={settings.restore}"
            continue
        try:
            engine = RESTORERS[name](settings, timeline)
            return StartedEngine(engine, name, skipped, order.report())
        except SkipPath as why:
            skipped[name] = str(why)
        except ConfigError:  # a bad setting fails every path alike: reported once, not fallen back from
            raise
        except Exception as exc:  # a broken snapshot must never keep the function from starting
            log.exception("restore path %s failed; falling back", name)
            skipped[name] = f"failed: {type(exc).__name__}: {exc}"
    for name, why in skipped.items():
        log.info("restore path %s skipped: %s", name, why)
    return StartedEngine(start_cold(settings, timeline), "cold", skipped, order.report())


def restore_gpu(settings: Settings, timeline: Timeline) -> "Engine":
    from snapshots.restore import restore_gpu

    return restore_gpu(settings, timeline)


def restore_process(settings: Settings, timeline: Timeline) -> "Engine":
    from snapshots.restore import restore_process

    return restore_process(settings, timeline)


def restore_materialized(settings: Settings, timeline: Timeline) -> "Engine":
    from snapshots.restore import restore_materialized

    return restore_materialized(settings, timeline, lambda: build_fresh(settings, timeline))


#: name -> restore function (raises SkipPath to fall through); snapshots/restore.py does the work, imported
#: only when a path is tried
RESTORERS: dict[str, Callable[[Settings, Timeline], "Engine"]] = {
    "gpu": restore_gpu, "process": restore_process, "materialized": restore_materialized}


def start_cold(settings: Settings, timeline: Timeline) -> "Engine":
    """What vLLM does: import, build, load the weights, profile the KV cache, capture graphs."""
    engine = build_fresh(settings, timeline)
    engine.start()
    return engine


def build_fresh(settings: Settings, timeline: Timeline, device: str | None = None) -> "Engine":
    """The CPU phase in this process: imports, tokenizer, model structure (not started); for DEVICE (cuda:N in
    a several-model instance; default: DEVICE resolved)."""
    import runtime.engine.llm_engine  # noqa: F401  torch and the engine: the bulk of runtime_init
    from runtime.launch import build_engine, engine_config

    timeline.mark(stages.RUNTIME_INIT)
    with timeline.stage(stages.MODEL_SOURCE, model=settings.model or "embedded"):
        model_dir = resolve_model(settings)
    return build_engine(model_dir, engine_config(settings, device), timeline, served_model_name(settings), settings)


# -- the model ---------------------------------------------------------------------------------------------

def _config_error(exc: ConfigError, lambda_api: str | None) -> int:
    print(f"faas-bootstrap: {exc}", file=sys.stderr)
    if lambda_api:
        from runtime.server.lambda_runtime import LambdaError, report_init_error

        report_init_error(lambda_api, LambdaError("Runtime.ConfigError", str(exc)))
    return 2


def check_model_ref(model: str | None) -> None:
    """Fail before listening on a MODEL (or one model of a MODEL list) that cannot be right; what can only
    be known by loading (a corrupt or unsupported model) fails in the start path."""
    if model is None:
        from runtime.weights.embedded import EmbeddedModelMissing, embedded_gguf_path

        try:
            embedded_gguf_path()
        except EmbeddedModelMissing as exc:
            raise ConfigError(str(exc)) from None
        return
    if model.startswith("s3://"):
        return
    path = Path(model).expanduser()
    if not path.exists():
        raise ConfigError(f"MODEL={model!r}: no such file or directory")


def resolve_model(settings: Settings) -> Path:
    """MODEL -> a local model directory (runtime/weights/resolve.py has the forms)."""
    from runtime.weights.resolve import resolve_model as resolve

    return resolve(settings.model, settings.cache_dir, settings.cache_max_gb)


def served_model_name(settings: Settings) -> str | None:
    if settings.served_model_name:
        return settings.served_model_name
    if settings.model is None:
        from runtime.weights.embedded import SERVED_NAME

        return SERVED_NAME
    return settings.model.rstrip("/").rsplit("/", 1)[-1] or settings.model


def _route_uvicorn_logs() -> None:
    # uvicorn runs with log_config=None (its own config would reset logging): its records join ours.
    import logging

    ours = logging.getLogger("thawllm")
    for name in ("uvicorn", "uvicorn.error", "uvicorn.access"):
        logger = logging.getLogger(name)
        logger.handlers = list(ours.handlers)
        logger.setLevel(ours.level)
        logger.propagate = False


if __name__ == "__main__":
    sys.exit(main())
