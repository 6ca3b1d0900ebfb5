"""GET /health: the Knative readiness and startup probe, and the instance's cold-start report.

503 while the engine starts (or after SIGTERM, or if it failed), 200 once it serves. The body says which
restore path was taken, why the faster ones were skipped, the order they were tried in (measured by
faas-build: which was fastest, by how much), how long each cold-start stage took (`timeline`)
and when each ran (`stages`: seconds since spawn; stages overlap where work runs in parallel). With several
models, `models` lists them and `pools` each device's pool: its free bytes and, per model, the bytes resident
and retained there, loads, switches, the last switch's seconds and where they went (making room, backing the
missing memory, streaming the weights) and what its first start spent (the weight stream, the graphs, the
kernels it loaded and how long the start waited for them).
"""

from __future__ import annotations

import orjson
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from runtime.server.handler import Handler
from runtime.server.state import AppState


def health_report(state: AppState) -> dict:
    report = {"status": state.phase, "model": state.model_name, "restore_path": state.restore_path,
              "skipped": state.skipped, "timeline": state.timeline.durations(), "stages": state.timeline.as_json()}
    if state.restore_order:
        report["restore_order"] = state.restore_order
    if state.error:
        report["error"] = state.error
    engines = state.models if state.models is not None else state.engine
    if engines is not None:
        stats = engines.stats()
        report["engine"] = {"running": stats.running, "waiting": stats.waiting,
                            "kv_blocks_used": stats.kv_blocks_used, "kv_blocks_total": stats.kv_blocks_total}
    if state.model_names:
        report["models"] = state.model_names
    if state.models is not None:
        report["placement"] = state.models.policy
        report["pools"] = {device: _pool_report(slot.pool.stats()) for device, slot in state.models.slots.items()}
    return report


def _pool_report(stats) -> dict:
    return {"free_bytes": stats.free_bytes, "budget_bytes": stats.budget_bytes,
            "models": {name: {"resident_bytes": m.resident_bytes, "retained_bytes": m.retained_bytes,
                              "total_bytes": m.total_bytes, "kv_bytes": m.kv_bytes, "requests_in_flight": m.held,
                              "loads": m.loads, "switches": m.switches,
                              "last_switch_s": m.last_switch_s, **_last_switch(m.last_switch),
                              "first_start": _first_start(m.first_start)}
                       for name, m in stats.models.items()}}


def _last_switch(report) -> dict:
    """The parts of last_switch_s spent on memory (0 before any switch loaded bytes)."""
    return {f"last_switch_{part}_s": getattr(report, f"{part}_s") if report is not None else 0.0
            for part in ("evict", "map", "stream")}


def _first_start(report) -> dict | None:
    """Where the activation that started a model's engine spent its time (None: not started yet)."""
    if report is None:
        return None
    return {"total_s": report.total_s, "stream_s": report.stream_s, "graphs_s": report.graphs_s,
            "graphs_restored": report.graphs_restored, "kernels_s": report.kernels_s,
            "kernels_critical_s": report.kernels_critical_s, "kernels_loaded": report.kernels_loaded}


def routes(state: AppState) -> list[Route]:
    async def health(request: Request) -> Response:
        status = 200 if state.ready else 503
        return Response(orjson.dumps(health_report(state)), status, media_type="application/json")

    return [Route("/health", health, methods=["GET"])]


handler = Handler(routes=routes, name="health")
