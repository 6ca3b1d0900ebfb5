"""Prometheus metrics: the cold start (stage durations, restore path), latency (TTFT, inter-token), tokens,
and the engine's queues and KV cache, read from the engine at scrape time.

Each app has its own registry, so several apps (tests, or a handler that builds its own) never collide.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Iterable

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

if TYPE_CHECKING:
    from runtime.server.state import AppState

# Buckets in seconds: TTFT spans a warm 10 ms to a queued multi-second prefill; ITL a few ms to ~0.5 s.
_TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
_ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28)


class ServerMetrics:
    def __init__(self, state: "AppState") -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.time_to_first_token = Histogram(
            "thawllm_time_to_first_token_seconds", "From request to its first generated token",
            buckets=_TTFT_BUCKETS, registry=r)
        self.inter_token_latency = Histogram(
            "thawllm_inter_token_latency_seconds", "Between consecutive tokens of one request",
            buckets=_ITL_BUCKETS, registry=r)
        self.generated_tokens = Counter("thawllm_generated_tokens", "Tokens generated", registry=r)
        self.prompt_tokens = Counter("thawllm_prompt_tokens", "Prompt tokens of finished requests", registry=r)
        self.finished_requests = Counter(
            "thawllm_requests_finished", "Requests finished, by finish reason", ["finish_reason"], registry=r)
        r.register(_StateCollector(state))

    def route(self) -> Route:
        async def metrics(request: Request) -> Response:
            return Response(generate_latest(self.registry), media_type=CONTENT_TYPE_LATEST)

        return Route("/metrics", metrics, methods=["GET"])


class _StateCollector(Collector):
    """Values that already live elsewhere (timeline, state, engine): read them when scraped."""

    def __init__(self, state: "AppState") -> None:
        self._state = state

    def collect(self) -> Iterable[Metric]:
        state = self._state
        stages = GaugeMetricFamily("thawllm_cold_start_stage_seconds",
                                   "Duration of each cold-start stage of this instance", labels=["stage"])
        for stage, seconds in state.timeline.durations().items():
            stages.add_metric([stage], seconds)
        yield stages
        path = GaugeMetricFamily("thawllm_restore_path", "The start path this instance took (1)",
                                 labels=["path"])
        if state.restore_path:
            path.add_metric([state.restore_path], 1)
        yield path
        yield GaugeMetricFamily("thawllm_ready", "1 while the engine serves requests",
                                value=1 if state.ready else 0)
        stats = state.engine.stats() if state.engine is not None else None
        for name, doc, value in (
                ("thawllm_requests_running", "Requests in the running batch", stats and stats.running),
                ("thawllm_requests_waiting", "Requests waiting to be scheduled", stats and stats.waiting),
                ("thawllm_kv_blocks_used", "KV-cache blocks in use", stats and stats.kv_blocks_used),
                ("thawllm_kv_blocks_total", "KV-cache blocks allocated", stats and stats.kv_blocks_total)):
            yield GaugeMetricFamily(name, doc, value=value or 0)
        steps = CounterMetricFamily(
            "thawllm_engine_steps", "Engine steps launched, by whether the previous step's tokens had been read "
            "(settled) or not yet (ahead: async scheduling)", labels=["launch"])
        if stats is not None:
            steps.add_metric(["ahead"], stats.steps_run_ahead)
            steps.add_metric(["settled"], stats.steps - stats.steps_run_ahead)
        yield steps
