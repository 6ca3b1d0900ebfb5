"""Prometheus metrics: the cold start (stage durations, restore path), latency (TTFT, inter-token), tokens,
and the engine's queues and KV cache, read from the engine at scrape time. The request metrics are also
exported under vLLM's names (`vllm:...`, labelled with `model_name`), so dashboards made for vLLM work.
With several models, the instance-wide series sum over their engines (the vLLM ones are labelled with
each request's model) and each model also has its own (`model` and `device` labels): resident and retained
bytes, loads, switches and switch seconds, beside each device pool's free bytes.

Each app has its own registry, so several apps (tests, or a handler that builds its own) never collide.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Iterable, Protocol

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

if TYPE_CHECKING:
    from runtime.engine.outputs import EngineStats
    from runtime.timeline import Timeline

# Buckets in seconds: TTFT spans a warm 10 ms to a queued multi-second prefill; ITL a few ms to ~0.5 s.
_TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
_ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28)
_E2E_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0)
# A switch spans a fully retained model (ms) to a whole 8B model streamed from disk (seconds).
_SWITCH_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)


class _Stats(Protocol):
    def stats(self) -> "EngineStats": ...


class _Models(Protocol):
    """Several models (runtime/server/models.py: ServedModels): their summed stats and each device's slot,
    whose `pool.stats()` the per-model series read."""

    slots: dict

    def stats(self) -> "EngineStats": ...


class Instance(Protocol):
    """What the metrics read at scrape time: the app's state (runtime/server/state.py: AppState) has it.
    A protocol, so that the state depends on the metrics and not the other way round."""

    timeline: "Timeline"
    model_name: str | None
    restore_path: str | None
    engine: _Stats | None
    models: _Models | None

    @property
    def ready(self) -> bool: ...


class ServerMetrics:
    def __init__(self, state: Instance) -> None:
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
        self._state = state
        model = ["model_name"]
        self.vllm_time_to_first_token = Histogram(
            "vllm:time_to_first_token_seconds", "Time to first token", model, buckets=_TTFT_BUCKETS, registry=r)
        self.vllm_inter_token_latency = Histogram(
            "vllm:inter_token_latency_seconds", "Inter-token latency", model, buckets=_ITL_BUCKETS, registry=r)
        self.vllm_e2e_latency = Histogram(
            "vllm:e2e_request_latency_seconds", "End-to-end request latency", model, buckets=_E2E_BUCKETS,
            registry=r)
        self.vllm_prompt_tokens = Counter("vllm:prompt_tokens", "Prefill tokens processed", model, registry=r)
        self.vllm_generation_tokens = Counter("vllm:generation_tokens", "Generation tokens processed", model,
                                              registry=r)
        self.vllm_request_success = Counter("vllm:request_success", "Finished requests, by finish reason",
                                            model + ["finished_reason"], registry=r)
        self.switch_seconds = Histogram(
            "thawllm_model_switch_seconds", "Making a model resident for a request (bytes moved), by model and "
            "device", ["model", "device"], buckets=_SWITCH_BUCKETS, registry=r)
        self.loaded_bytes = Counter(
            "thawllm_model_loaded_bytes", "Weight bytes streamed into a device pool for a model (its first start "
            "and every switch that found bytes missing)", ["model", "device"], registry=r)
        r.register(_StateCollector(state))

    def _model(self, model: str | None) -> str:
        """The vLLM series' model_name: the request's model (several models) or the instance's."""
        return model or self._state.model_name or ""

    def first_token(self, seconds: float, model: str | None = None) -> None:
        self.time_to_first_token.observe(seconds)
        self.vllm_time_to_first_token.labels(self._model(model)).observe(seconds)

    def tokens(self, n: int, gap: float | None, model: str | None = None) -> None:
        """`n` tokens generated; `gap` seconds since the previous ones (None for the first)."""
        if gap is not None:
            for _ in range(n):
                self.inter_token_latency.observe(gap / n)
                self.vllm_inter_token_latency.labels(self._model(model)).observe(gap / n)
        self.generated_tokens.inc(n)
        self.vllm_generation_tokens.labels(self._model(model)).inc(n)

    def finished(self, finish_reason: str | None, prompt_tokens: int, seconds: float,
                 model: str | None = None) -> None:
        reason = finish_reason or "unknown"
        self.prompt_tokens.inc(prompt_tokens)
        self.finished_requests.labels(reason).inc()
        self.vllm_prompt_tokens.labels(self._model(model)).inc(prompt_tokens)
        self.vllm_request_success.labels(self._model(model), reason).inc()
        self.vllm_e2e_latency.labels(self._model(model)).observe(seconds)

    def route(self) -> Route:
        async def metrics(request: Request) -> Response:
            return Response(generate_latest(self.registry), media_type=CONTENT_TYPE_LATEST)

        return Route("/metrics", metrics, methods=["GET"])


class _StateCollector(Collector):
    """Values that already live elsewhere (timeline, state, engine): read them when scraped."""

    def __init__(self, state: Instance) -> None:
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
        engines = state.models if state.models is not None else state.engine
        stats = engines.stats() if engines is not None else None
        for name, doc, value in (
                ("thawllm_requests_running", "Requests in the running batch", stats and stats.running),
                ("thawllm_requests_waiting", "Requests waiting to be scheduled", stats and stats.waiting),
                ("thawllm_kv_blocks_used", "KV-cache blocks in use", stats and stats.kv_blocks_used),
                ("thawllm_kv_blocks_total", "KV-cache blocks allocated", stats and stats.kv_blocks_total)):
            yield GaugeMetricFamily(name, doc, value=value or 0)
        model = state.model_name or ""
        for name, doc, value in (
                ("vllm:num_requests_running", "Requests in the running batch", stats and stats.running),
                ("vllm:num_requests_waiting", "Requests waiting to be scheduled", stats and stats.waiting),
                ("vllm:kv_cache_usage_perc", "KV-cache usage (1 is full)",
                 stats and stats.kv_blocks_total and stats.kv_blocks_used / stats.kv_blocks_total)):
            gauge = GaugeMetricFamily(name, doc, labels=["model_name"])
            gauge.add_metric([model], value or 0)
            yield gauge
        steps = CounterMetricFamily(
            "thawllm_engine_steps", "Engine steps launched, by whether the previous step's tokens had been read "
            "(settled) or not yet (ahead: async scheduling)", labels=["launch"])
        if stats is not None:
            steps.add_metric(["ahead"], stats.steps_run_ahead)
            steps.add_metric(["settled"], stats.steps - stats.steps_run_ahead)
        yield steps
        queries, hits = (stats.prefix_cache_queries, stats.prefix_cache_hits) if stats is not None else (0, 0)
        yield CounterMetricFamily("thawllm_prefix_cache_queries", "Prompt tokens looked up in the prefix cache",
                                  value=queries)
        yield CounterMetricFamily("thawllm_prefix_cache_hits", "Prompt tokens found in the prefix cache (their "
                                  "keys and values reused, not computed)", value=hits)
        for name, doc, value in (("vllm:prefix_cache_queries", "Prefix cache queries, in tokens", queries),
                                 ("vllm:prefix_cache_hits", "Prefix cache hits, in tokens", hits)):
            counter = CounterMetricFamily(name, doc, labels=["model_name"])
            counter.add_metric([model], value)
            yield counter
        if state.models is not None:
            yield from _pool_metrics(state)


def _pool_metrics(state: Instance) -> Iterable[Metric]:
    labels = ["model", "device"]
    resident = GaugeMetricFamily("thawllm_model_resident_bytes", "Weight bytes of a model in place for serving",
                                 labels=labels)
    retained = GaugeMetricFamily("thawllm_model_retained_bytes",
                                 "Weight bytes of an inactive model kept in the pool", labels=labels)
    total = GaugeMetricFamily("thawllm_model_bytes", "Weight bytes of a model", labels=labels)
    loads = CounterMetricFamily("thawllm_model_loads", "Loads of a model's weights into the pool", labels=labels)
    switches = CounterMetricFamily("thawllm_model_switches", "Times a model was made resident for a request",
                                   labels=labels)
    free = GaugeMetricFamily("thawllm_pool_free_bytes", "Bytes of a device pool holding nothing", labels=["device"])
    used = GaugeMetricFamily("thawllm_pool_used_bytes", "Bytes of a device pool in use: weights, KV caches and the "
                             "engines' own buffers", labels=["device"])
    for device, slot in state.models.slots.items():
        stats = slot.pool.stats()
        free.add_metric([device], stats.free_bytes)
        used.add_metric([device], stats.used_bytes)
        for name, m in stats.models.items():
            resident.add_metric([name, device], m.resident_bytes)
            retained.add_metric([name, device], m.retained_bytes)
            total.add_metric([name, device], m.total_bytes)
            loads.add_metric([name, device], m.loads)
            switches.add_metric([name, device], m.switches)
    yield from (resident, retained, total, loads, switches, free, used)
