"""The engine: an async `generate()` in front of a step loop that runs on its own thread.

Two phases, so that a process snapshot can be taken between them (snapshots/process):
`Engine.build()` does everything that needs no device (tokenizer, model config, the model on the meta
device, the weight plan); `Engine.start()` initialises the device, allocates and streams the weights, sizes
and allocates the KV cache and captures (or restores) the decode CUDA graphs, then starts the step loop.
"""

from __future__ import annotations

import asyncio
import queue
import threading
import time
import uuid
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, AsyncIterator, Callable, Protocol

import torch

from runtime import timeline as stages
from runtime.background import in_background
from runtime.config import ConfigError
from runtime.engine.allocator import MemoryProvider
from runtime.engine.block_manager import BlockManager
from runtime.cuda_driver.device import create_primary_context, use_device
from runtime.engine.cpu.threads import cpu_threads
from runtime.engine.detokenizer import OutputText
from runtime.engine.engine_config import EngineConfig
from runtime.engine.grammar import GrammarCompiler
from runtime.engine.graph_gate import GraphGate, GraphWorkStopped
from runtime.engine.layers.linear import pack_linears
from runtime.engine.layers.rotary import rope_table
from runtime.engine.model_config import ModelConfig
from runtime.engine.model_runner import KVProfile, ModelRunner, PendingTokens
from runtime.engine.models.llama import build_on_meta
from runtime.engine.outputs import EngineStats, RequestCut, RequestOutput, TokenLogprob
from runtime.engine.sampler import SampledBatch, SampledToken, Sampler
from runtime.engine.sampling_params import InvalidParams, SamplingParams
from runtime.engine.scheduler import ScheduledBatch, Scheduler
from runtime.engine.sequence import PENDING, Sequence
from runtime.engine.tokenizer import Tokenizer
from runtime.engine.weight_plan import WeightPlan, plan_weights
from runtime.logs import get_logger
from runtime.timeline import Timeline, thread_usage

if TYPE_CHECKING:
    from runtime.engine.embedding_fill import EmbeddingFill
    from runtime.weights.embedding_blocks import EmbeddingBlocks
    from runtime.weights.errors import WeightsError
    from runtime.weights.manifest import Manifest

log = get_logger("engine")

DEFAULT_MAX_MODEL_LEN = 4096
#: how long the step loop waits, when waiting requests find no KV memory, before asking for it again
STALL_WAIT_S = 0.002
#: the longest the graph work left for after ready waits for the engine to be idle, per piece of work
GRAPHS_STEP_ASIDE_S = 0.5
#: the rest of a deferred embedding table is read once a step has run, or this long after ready without one
FILL_AFTER_READY_S = 0.5


class WeightLoad(Protocol):
    def wait(self) -> object: ...
    def detail(self) -> dict: ...  # for the weights stage, once waited for: rates, how it read and verified


#: starts filling the flat weight buffer and returns at once (runtime/weights/loader.py provides one)
LoadWeights = Callable[[WeightPlan, torch.Tensor], WeightLoad]


class GraphRestorer(Protocol):
    """Rebuilds the decode graphs from a materialised description instead of capturing them
    (snapshots/cudagraph). `restore` returns the batch sizes it could not restore, which are captured live;
    the sizes it leaves `pending` are built by `restore_pending` on a thread of their own once the engine
    serves (a batch that finds its graph not built yet runs on a larger one, or eagerly)."""

    timings: dict[str, float]  # seconds of each part of the restore, for the timeline
    pending: list[int]
    pending_timings: dict[str, float]
    before_weights: bool  # restore before the weight copies start (else beside them)

    def read_ahead(self) -> None:
        """Start reading the description, on a thread: called before CUDA is initialised."""

    def restore(self, runner: ModelRunner) -> dict[int, str]: ...

    def restore_pending(self, runner: ModelRunner, step_aside: Callable[[], None]) -> dict[int, str]:
        """STEP_ASIDE is called between units of work: it returns once the engine has no request to run."""


class WeightHandover(Protocol):
    """Device memory another process streams the weights into while this one is being restored (a process
    snapshot's restore: snapshots/weights_during_restore.py). The engine maps it as soon as it exists and
    sets up around it; it serves nothing before `arrived()`."""

    def take(self) -> tuple[int, int] | None:
        """Block until the memory is there, its weights maybe still arriving: (POSIX descriptor, bytes) of the
        exported memory, or None (why is logged): the engine streams the weights itself."""

    def mapped(self, ok: bool) -> None:
        """The memory is mapped (or failed to map: the other process is let go)."""

    def arrived(self) -> tuple[float, float, dict] | None:
        """Block until every weight is in the memory and checked: (time.time() the weights started and
        finished arriving, the timeline's detail); None (why is logged) if they did not all arrive: the
        memory is not used, and the engine streams the weights itself."""

    #: once arrived: the layout chunks the other process left out (EMBEDDING_LAST), for this one to read
    deferred: frozenset[int]


@dataclass
class _Request:
    seq: Sequence
    text: OutputText
    loop: asyncio.AbstractEventLoop
    outputs: asyncio.Queue
    stop_ids: set[int] = field(default_factory=set)


@dataclass
class _Step:
    """A launched step whose tokens the host has not read yet."""

    seqs: list[Sequence]  # the step's sequences that sample a token (not those part-way through a prompt)
    sampled: SampledBatch
    indices: list[int]  # where each sequence's token of this step goes in its output_ids

    def pending(self) -> PendingTokens:
        return PendingTokens(self.sampled.tokens, {seq: row for row, seq in enumerate(self.seqs)})


class Engine:
    def __init__(self, model_dir: Path, model_config: ModelConfig, tokenizer: Tokenizer, config: EngineConfig,
                 load_weights: LoadWeights, timeline: Timeline, model_name: str) -> None:
        self.model_dir = model_dir
        self.model_config = model_config
        self.tokenizer = tokenizer
        self.config = config
        self.model_name = model_name
        self.timeline = timeline
        self.max_model_len = config.max_model_len or min(DEFAULT_MAX_MODEL_LEN, model_config.max_position_embeddings)
        self.plan = plan_weights(model_config, config.dtype)
        self.model = build_on_meta(model_config)
        self.grammars = GrammarCompiler(tokenizer, model_config.vocab_size)
        self._load_weights = load_weights
        self.runner: ModelRunner | None = None
        self.kv_profile: KVProfile | None = None
        self.graph_fallbacks: dict[int, str] = {}
        self._graphs_thread: threading.Thread | None = None
        self.graph_gate = GraphGate()  # when that graph work may touch the model's memory (a pool evicts it)
        self._device_lock = threading.Lock()
        self._device_span: tuple[float, float, dict] | None = None  # (start, end, the cuda_init stage's detail)
        self.ready = False
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._requests: dict[str, _Request] = {}
        self._thread: threading.Thread | None = None
        self._in_flight: _Step | None = None
        self._steps = self._steps_run_ahead = 0
        self.embedding_fill: "EmbeddingFill | None" = None  # rows of the table still to read (EMBEDDING_LAST)

    # -- construction ------------------------------------------------------------------------------

    @classmethod
    def build(cls, model_dir: str | Path, load_weights: LoadWeights, config: EngineConfig,
              timeline: Timeline | None = None, model_name: str | None = None) -> "Engine":
        """Everything that needs no device: safe to run before a CRIU checkpoint."""
        timeline = timeline or Timeline()
        model_dir = Path(model_dir)
        with timeline.stage(stages.TOKENIZER):
            tokenizer = Tokenizer(model_dir)
        with timeline.stage(stages.MODEL_STRUCTURE):
            model_config = ModelConfig.from_dir(model_dir)
            engine = cls(model_dir, model_config, tokenizer, config, load_weights, timeline,
                         model_name or model_dir.name)
        if config.on_cuda:
            from runtime.cuda_driver import import_bindings
            from runtime.engine.kernels import prepare_kernels

            with timeline.stage(stages.KERNEL_PREP):
                prepare_kernels()
                import_bindings()
        if config.max_model_len and config.max_model_len > model_config.max_position_embeddings:
            raise ConfigError(f"MAX_MODEL_LEN={config.max_model_len}: must be at most the model's context, "
                              f"{model_config.max_position_embeddings} positions")
        return engine

    def init_device(self, ahead: bool = False) -> None:
        """Initialise CUDA (or set the CPU's threads), once. AHEAD: called on a thread of its own before
        `start`, which then only waits for it (a restored process starts it the moment it resumes)."""
        with self._device_lock:
            if self._device_span is not None:
                return
            started = time.time()
            device = torch.device(self.config.device)
            detail: dict = {}
            if device.type == "cuda":
                if ahead:  # the context's creation without the GIL: the thread that called this goes on
                    detail["ahead"] = True
                    with thread_usage(detail, "context"):
                        create_primary_context(device.index or 0)
                    detail["context_s"] = round(time.time() - started, 4)
                torch_started = time.time()
                use_device(device)
                torch.cuda.init()
                torch.empty(1, device=device)
                detail["torch_s"] = round(time.time() - torch_started, 4)
            else:
                torch.set_num_threads(self.config.cpu_threads or cpu_threads())
            self._device_span = (started, time.time(), detail)

    def start(self, kv_blocks: int | None = None, graph_restorer: GraphRestorer | None = None,
              capture_graphs: bool = True, releasable_memory: bool = False,
              memory: MemoryProvider | None = None, handover: WeightHandover | None = None) -> None:
        """Device phase. With `kv_blocks` and `graph_restorer` (materialised state) the KV profile and the
        graph capture are skipped: the KV cache, and the graphs when the restorer says so, are set up before the
        weights stream in (else beside them); without them, like vLLM: load, then profile, then capture.
        `capture_graphs=False` leaves the graphs to the caller (faas-build materialises them).
        `releasable_memory` puts the weights and the KV cache where `release_device_memory` can free them.
        `memory`: where the weights and the KV cache live when a multi-model pool owns them (runtime/pool).
        `handover`: the weights are already on the device, in memory another process streamed them into."""
        t = self.timeline
        called = time.time()
        if graph_restorer is not None:
            graph_restorer.read_ahead()  # while CUDA initialises, which leaves the GIL free most of the time
        # host work the KV stage would wait for (about 5 ms for 32k positions on the H200 machine): beside it too
        rope = (in_background(rope_table, self.model_config, self.max_model_len, name="rope-table")
                if self.config.on_cuda else None)
        self.init_device()
        started, ended, detail = self._device_span
        t.record(stages.CUDA_INIT, started, ended, device=self.config.device, **detail)
        device = torch.device(self.config.device)
        if device.type == "cuda":  # current per thread, and this one may not be the one that initialised it
            use_device(device if device.index is not None else torch.device("cuda", torch.cuda.current_device()))
        prepared = time.time()
        runner = ModelRunner(self.model, self.model_config, self.config, self.max_model_len, memory)
        self.runner = runner
        buffer, adopted = self._weight_buffer(runner, releasable_memory, handover)
        # from the device to the KV cache: how much later than the device this start was called, from then to
        # the runner (this thread's wait for the GIL, the device made current), and the runner, the weight buffer
        # and the parameters' views of it
        before_kv = {"called_after_device_s": round(max(0.0, called - ended), 4),
                     "device_to_runner_s": round(prepared - max(called, ended), 4),
                     "weight_buffer_s": round(time.time() - prepared, 4)}
        graphs = bool(runner.graph_batch_sizes) and (capture_graphs or graph_restorer is not None)
        materialized = kv_blocks is not None
        graphs_first = materialized and graphs and graph_restorer is not None and graph_restorer.before_weights
        if materialized:  # sized already: allocated before the weight readers pin their buffers and fill the
            # copy engines, which stretched this 0.02-0.03 s stage to 0.2-0.5 s when the two overlapped (H100)
            kv_blocks = self._allocate_kv(runner, kv_blocks, releasable_memory, before_kv, rope)
        if graphs_first:
            self._prepare_graphs(runner, graph_restorer)
        beside = materialized and graphs and not graphs_first  # no weight values needed: beside the stream
        arrived = None
        if adopted:  # the helper's memory: set up around it while its weights arrive, serve once they all have
            if beside:
                self._prepare_graphs(runner, graph_restorer)
                beside = False
            waited = time.time()
            # read while the weights arrive: from a busy disk the file waits behind the weights' reads
            blocks = self._embedding_blocks() if self._may_defer_embedding() else None
            arrived = handover.arrived()
            if arrived is None:  # the helper's copies may still land there: stream into new memory instead
                runner.allocator.releasable("weights").replace_adopted()
        if arrived is not None:
            started, finished, detail = arrived
            t.record(stages.WEIGHTS, started, finished, **detail, waited_s=round(time.time() - waited, 4))
            if handover.deferred:
                self.defer_embedding(handover.deferred, buffer, blocks=blocks)
        else:
            with t.stage(stages.WEIGHTS, bytes=self.plan.total_bytes) as weights_stage:  # ended even if it fails
                load = self._load_weights(self.plan, buffer)
                if beside:
                    self._prepare_graphs(runner, graph_restorer)
                load.wait()
                weights_stage.detail.update(load.detail())
                if device.type == "cpu" and self.config.cpu_packed_weights:
                    packed = pack_linears(self.model)
                    weights_stage.detail.update(packed)
                    runner.packed_steps = packed["packed_layers"] > 0 and packed["float_layers"] == 0
        if not materialized:
            kv_blocks = self._allocate_kv(runner, kv_blocks, releasable_memory, before_kv, rope)
            if graphs:
                self._prepare_graphs(runner, graph_restorer)
        self.blocks = BlockManager(kv_blocks, self.config.block_size, reserved=runner.reserved_blocks,
                                   capacity=memory.kv_capacity() if memory is not None else None,
                                   prefix_caching=self.config.enable_prefix_caching)
        self.scheduler = Scheduler(self.blocks, self.config.max_num_seqs, self.config.max_num_batched_tokens)
        self.sampler = Sampler(device, self.config.seed, self.tokenizer.eos_token_ids)
        self._thread = threading.Thread(target=self._run, name="engine-loop", daemon=True)
        self._thread.start()
        self.ready = True
        if graph_restorer is not None and graph_restorer.pending:
            self._graphs_thread = threading.Thread(target=self._restore_pending_graphs, args=(graph_restorer,),
                                                   name="graphs-after-ready", daemon=True)
            self._graphs_thread.start()

    def defer_embedding(self, deferred: frozenset[int], buffer: torch.Tensor, fill_now: bool = True,
                        blocks: "EmbeddingBlocks | WeightsError | None" = None) -> None:
        """The layout chunks DEFERRED (part of the embedding table) are not in BUFFER yet: serve while they are
        read (runtime/engine/embedding_fill.py), in the background unless FILL_NOW is False (then only the
        rows steps need, until `embedding_fill.start()`). BLOCKS: the layout's block digests, or why they
        could not be read, if read already. Where they cannot be used, read the chunks now, as the weights
        stream would have."""
        from runtime.engine.embedding_fill import EmbeddingFill

        blocks = blocks or self._embedding_blocks()
        if isinstance(blocks, Exception):
            log.warning("embedding table: %s; reading the rest of it before serving", blocks)
            self._load_weights(self.plan, buffer, only=deferred).wait()
            return
        self.embedding_fill = fill = EmbeddingFill(blocks, self._manifest(), deferred, buffer, self.timeline)
        if fill_now:
            fill.start(after_first_step_s=FILL_AFTER_READY_S)

    def _manifest(self) -> "Manifest":
        from runtime.weights.manifest import Manifest

        return getattr(self._load_weights, "manifest", None) or Manifest.read(self.model_dir)

    def _embedding_blocks(self) -> "EmbeddingBlocks | WeightsError":
        """The layout's embedding block digests, or why they cannot be used."""
        from runtime.weights.embedding_blocks import EmbeddingBlocks
        from runtime.weights.errors import WeightsError

        try:
            return EmbeddingBlocks.read(self.model_dir, self._manifest())
        except WeightsError as exc:
            return exc

    def _may_defer_embedding(self) -> bool:
        from runtime.weights.embedding_blocks import BLOCKS_FILE
        from runtime.weights.errors import WeightsError

        try:
            return BLOCKS_FILE in self._manifest().model_files
        except (OSError, WeightsError):  # not a layout: nothing is deferred
            return False

    def _weight_buffer(self, runner: ModelRunner, releasable: bool, handover: WeightHandover | None,
                       ) -> tuple[torch.Tensor, bool]:
        """The weight buffer, and whether it is a HANDOVER's memory (else it is new memory for the loader)."""
        exported = handover.take() if handover is not None else None
        if exported is not None:
            try:
                buffer = runner.allocate_weights(self.plan, releasable, adopt=exported)
            except Exception as exc:  # never fatal: the weights stream as they would without a handover
                log.warning("mapping the weights streamed during the restore failed (%s); streaming them now", exc)
                handover.mapped(False)
            else:
                handover.mapped(True)
                return buffer, True
        return runner.allocate_weights(self.plan, releasable), False

    def _allocate_kv(self, runner: ModelRunner, kv_blocks: int | None, releasable: bool,
                     detail: dict | None = None, rope: Future | None = None) -> int:
        """The KV cache: `config.num_kv_blocks` if set, else `kv_blocks` (materialised), else profiled on
        cuda or sized by memory on cpu. Returns its blocks. DETAIL: more for the stage's detail; ROPE: the
        rotary table, being computed."""
        with self.timeline.stage(stages.KV_CACHE, materialized=kv_blocks is not None, **(detail or {})) as kv_stage:
            runner.allocate_static(rope.result() if rope is not None else None)
            if self.config.num_kv_blocks:
                kv_blocks = self.config.num_kv_blocks
            elif kv_blocks is None and runner.device.type == "cuda":
                self.kv_profile = runner.profile_kv_blocks()
                kv_blocks = self.kv_profile.num_blocks
            elif kv_blocks is None:
                kv_blocks = runner.cpu_kv_blocks()
            runner.allocate_kv(kv_blocks, releasable)
            kv_stage.detail["blocks"] = kv_blocks
        return kv_blocks

    def _prepare_graphs(self, runner: ModelRunner, restorer: GraphRestorer | None) -> None:
        """Restore the decode graphs from materialised state, capturing live whichever could not be."""
        with self.timeline.stage(stages.CUDA_GRAPHS, restored=restorer is not None) as graph_stage:
            if restorer is not None:
                self.graph_fallbacks = restorer.restore(runner)
                graph_stage.detail.update(restorer.timings)
                for bs, why in self.graph_fallbacks.items():
                    log.warning("graph for batch size %d captured live: %s", bs, why)
            pending = set(restorer.pending) if restorer is not None else set()
            missing = [bs for bs in runner.graph_batch_sizes if bs not in runner.graphs and bs not in pending]
            if missing:
                runner.capture_graphs(sizes=missing)
            graph_stage.detail["graphs"] = len(runner.graphs)
            if pending:
                graph_stage.detail["pending"] = len(pending)

    def _restore_pending_graphs(self, restorer: GraphRestorer) -> None:
        use_device(self.runner.device)
        sizes = list(restorer.pending)
        try:
            # the request that woke a scaled-to-zero function is usually waiting as the engine becomes ready
            self._step_aside(until_served=True)
            with self.timeline.stage(stages.GRAPHS_AFTER_READY, graphs=len(sizes)) as stage:
                try:
                    fallbacks = restorer.restore_pending(self.runner, self._step_aside)
                except Exception as exc:  # the engine keeps serving on the graphs it has
                    log.exception("restoring the remaining CUDA graphs failed")
                    fallbacks = {bs: str(exc) for bs in sizes if bs not in self.runner.graphs}
                stage.detail.update(restorer.pending_timings)
        except GraphWorkStopped:
            return  # shut down while its model was evicted
        finally:
            self.graph_gate.leave()
        for bs, why in fallbacks.items():
            log.warning("graph for batch size %d not restored (%s): its batches run on a larger graph or eagerly",
                        bs, why)
        self.graph_fallbacks.update(fallbacks)

    @property
    def weights_loader(self) -> LoadWeights:
        """What fills the weight buffer (a multi-model pool streams evicted parts back with it)."""
        return self._load_weights

    def _step_aside(self, until_served: bool = False) -> None:
        """Before a piece of the graph work left for after ready: wait, GRAPHS_STEP_ASIDE_S at most, while
        requests run (UNTIL_SERVED: until one has been served). Its module loads and its hold on the GIL
        otherwise slow the first requests after a restore; the bound keeps a steady load from starving it
        of its larger graphs."""
        deadline = time.monotonic() + GRAPHS_STEP_ASIDE_S
        self.graph_gate.leave()
        while (not self.idle or (until_served and self._steps == 0)) and time.monotonic() < deadline:
            time.sleep(0.002)
        self.graph_gate.enter()

    @property
    def idle(self) -> bool:
        """No request scheduled and no step in flight."""
        return not self.scheduler.has_work() and self._in_flight is None and self._inbox.empty()

    def wait_for_graphs(self, timeout: float | None = None) -> bool:
        """Wait until the graphs left for after ready are built; False if `timeout` ran out first."""
        if self._graphs_thread is not None:
            self._graphs_thread.join(timeout)
            return not self._graphs_thread.is_alive()
        return True

    def release_device_memory(self) -> int:
        """Free the physical memory of the weights and the KV cache, keeping their addresses (a weight-less
        gpu snapshot is taken after this). The engine must not run until `reload_weights()`. Returns bytes."""
        return self.runner.allocator.release()

    def reload_weights(self) -> WeightLoad:
        """Map new memory at the released addresses and stream the weights into it; returns the load (its
        `wait()` is the end). The CUDA graphs and every parameter view still point at the right places."""
        runner = self.runner
        runner.allocator.remap()
        return self._load_weights(self.plan, runner.weight_buffer)

    # -- the async API -----------------------------------------------------------------------------

    async def generate(self, prompt: str | list[int], params: SamplingParams,
                       request_id: str | None = None) -> AsyncIterator[RequestOutput]:
        if not self.ready:
            raise RuntimeError("the engine is not started")
        prompt_ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
        self._check_prompt(prompt_ids, params)
        request_id = request_id or uuid.uuid4().hex
        if request_id in self._requests:
            raise InvalidParams("request_id", f"request {request_id} is already running")
        stop_ids = set(params.stop_token_ids)
        if not params.ignore_eos:
            stop_ids |= self.tokenizer.eos_token_ids
        seq = Sequence(request_id, prompt_ids, params)
        if params.grammar is not None:  # compiled off the event loop: a new schema takes milliseconds
            seq.grammar = await asyncio.to_thread(self.grammars.matcher, params.grammar)
            shortest = seq.grammar.shortest
            if shortest is not None and shortest > params.max_tokens:
                raise InvalidParams("max_tokens", f"max_tokens is {params.max_tokens}, but the shortest output that "
                                    f"follows '{params.grammar.param}' takes {shortest} tokens")
        request = _Request(seq,
                           OutputText(self.tokenizer, prompt_ids, params.stop),
                           asyncio.get_running_loop(), asyncio.Queue(), stop_ids)
        self._requests[request_id] = request
        self._inbox.put(("add", request))
        finished = False
        try:
            while not finished:
                out = await request.outputs.get()
                if isinstance(out, BaseException):
                    raise out
                finished = out.finished
                yield out
        finally:
            if not finished:
                self._inbox.put(("abort", request_id))

    async def abort(self, request_id: str) -> None:
        self._inbox.put(("abort", request_id))

    def cut_requests(self, reason: str) -> None:
        """End every request now: each `generate()` raises RequestCut(reason) and its blocks are freed (a
        shutdown whose grace period is over). Any thread."""
        self._inbox.put(("cut", reason))

    def reset_step_counts(self) -> None:
        """Forget the steps run so far and the prefix-cache counts (stats() counts from here): after a warm-up
        (runtime/engine/warm_up.py)."""
        self._steps = self._steps_run_ahead = 0
        self.blocks.query_tokens = self.blocks.hit_tokens = 0

    def stats(self) -> EngineStats:
        if not self.ready:
            return EngineStats(0, 0, 0, 0)
        blocks = self.blocks
        return EngineStats(len(self.scheduler.running), len(self.scheduler.waiting), blocks.num_used,
                           blocks.num_blocks, self._steps, self._steps_run_ahead, blocks.query_tokens,
                           blocks.hit_tokens)

    def shutdown(self) -> None:
        """Stop the step loop and give the device memory back (the engine cannot be started again)."""
        self.graph_gate.stop()
        self.wait_for_graphs()
        if self._thread is not None:
            self._inbox.put(("stop", None))
            self._thread.join(timeout=10)
            self._thread = None
        if self.embedding_fill is not None:
            self.embedding_fill.stop()
        self.ready = False
        self.runner = None
        self.model = build_on_meta(self.model_config)  # drop the parameters' views of the weight buffer
        if self.config.on_cuda:
            import gc

            gc.collect()
            torch.cuda.empty_cache()

    def _check_prompt(self, prompt_ids: list[int], params: SamplingParams) -> None:
        if not prompt_ids:
            raise InvalidParams("prompt", "the prompt is empty")
        total = len(prompt_ids) + params.max_tokens
        if total > self.max_model_len:
            raise InvalidParams(
                "max_tokens", f"This model's maximum context length is {self.max_model_len} tokens. However, you "
                f"requested {total} tokens ({len(prompt_ids)} in the prompt, {params.max_tokens} for the completion).")
        capacity = self.blocks.num_blocks * self.config.block_size
        if total > capacity:
            raise InvalidParams("max_tokens", f"the request needs {total} tokens of KV cache but the whole cache "
                                f"holds {capacity}")
        vocab = self.model_config.vocab_size
        if max(prompt_ids) >= vocab or min(prompt_ids) < 0:
            raise InvalidParams("prompt", "the prompt has token ids outside the vocabulary")
        for param, ids in (("logit_bias", params.logit_bias), ("stop_token_ids", params.stop_token_ids)):
            if any(t >= vocab for t in ids):
                raise InvalidParams(param, f"{param} has token ids outside the vocabulary (0-{vocab - 1})")

    # -- the step loop (engine thread) -------------------------------------------------------------

    def _run(self) -> None:
        use_device(self.runner.device)
        stalled = False
        while True:
            idle = not self.scheduler.has_work() and self._in_flight is None
            # stalled: work waits for KV memory a pool has not given yet; wait a little (or for new requests
            # and aborts) before asking again, instead of spinning
            if not self._drain_inbox(block=idle or stalled, timeout=None if idle else STALL_WAIT_S):
                return
            try:
                stalled = not self._step()
            except Exception as exc:  # a failed step fails its requests; the engine keeps serving
                log.exception("engine step failed")
                self._in_flight = None
                for request_id in [s.request_id for s in (*self.scheduler.running, *self.scheduler.waiting)]:
                    self._fail(request_id, exc)

    def _drain_inbox(self, block: bool, timeout: float | None = None) -> bool:
        while True:
            try:
                kind, item = self._inbox.get(block=block, timeout=timeout if block else None)
            except queue.Empty:
                return True
            block = False
            if kind == "stop":
                return False
            if kind == "add":
                self.scheduler.add(item.seq)
            elif kind == "abort":
                self._finish(item, "abort")
            elif kind == "cut":
                for request_id in list(self._requests):
                    self._fail(request_id, RequestCut(item))

    def _step(self) -> bool:
        """Schedule and launch a step; with async scheduling, launch it before reading the last step's
        tokens (the next step's inputs come from them on the device), so the host's reading, stop checks
        and detokenising overlap the device's work instead of leaving it idle. False: nothing could run."""
        ahead, self._in_flight = self._in_flight, None
        if ahead is not None and not self._may_run_ahead(ahead):
            self._settle(ahead)
            ahead = None
        batch = self.scheduler.schedule()
        if batch is None:
            if ahead is not None:
                self._settle(ahead)
            return ahead is not None
        if self.embedding_fill is not None and not self._rows_in(batch):
            return True
        logits = self.runner.execute(batch, self.blocks, ahead.pending() if ahead is not None else None)
        seqs = batch.sampling_seqs
        step = self._launched(batch, seqs, self.sampler(logits, seqs) if seqs else None)
        self._steps += 1
        if self.embedding_fill is not None:
            self.embedding_fill.stepped()
        if ahead is not None:
            self._steps_run_ahead += 1
            self._settle(ahead)
        if step is None:  # only slices of prompts: nothing to read
            return True
        if self.config.async_scheduling:
            self._in_flight = step
        else:
            self._settle(step)
        return True

    def _rows_in(self, batch: ScheduledBatch) -> bool:
        """The embedding rows of the batch's tokens are in the table (no step runs ahead while some are not:
        its tokens must be known). False: some failed their check, and the requests that needed them failed."""
        from runtime.engine.embedding_fill import BadRows

        fill = self.embedding_fill
        if fill.complete.is_set():
            self.embedding_fill = None
            fill.close()
            return True
        wanted = {}
        for seq, n, sample in zip(batch.seqs, batch.num_new_tokens, batch.samples):
            start = seq.num_computed_tokens
            wanted[seq] = [seq.last_token] if n == 1 and sample else seq.tokens_between(start, start + n)
        try:
            fill.ensure(token for tokens in wanted.values() for token in tokens)
        except BadRows as exc:
            for seq, tokens in wanted.items():
                if exc.rows.intersection(tokens):
                    self._fail(seq.request_id, exc)
            return False
        return True

    def _may_run_ahead(self, step: _Step) -> bool:
        """Whether the next step may be launched before `step`'s tokens are read: not when a sequence ends by
        length at `step` (known in advance: no step is wasted on it). Waiting requests may join: a prefill
        never holds a PENDING token (a preempted sequence is settled before it can be scheduled again), and
        the penalties count tokens on the device (runtime/engine/penalties.py). Nor when a sequence has a
        grammar: its next mask follows from the token this step chooses."""
        if self.embedding_fill is not None:  # the next step's rows are read by its tokens
            return False
        return not any(seq.grammar is not None or index + 1 >= seq.params.max_tokens
                       or seq.num_prompt_tokens + index + 1 >= self.max_model_len
                       for seq, index in zip(step.seqs, step.indices))

    def _launched(self, batch: ScheduledBatch, seqs: list[Sequence], sampled: SampledBatch | None) -> _Step | None:
        """Account for a launched step: its tokens are computed, and each sequence that sampled has one more
        output token, PENDING until the step is settled. None when no sequence sampled."""
        for seq, n in zip(batch.seqs, batch.num_new_tokens):
            seq.num_computed_tokens += n
        indices = []
        for seq in seqs:
            indices.append(len(seq.output_ids))
            seq.output_ids.append(PENDING)
        return _Step(seqs, sampled, indices) if seqs else None

    def _settle(self, step: _Step) -> None:
        """Read a launched step's tokens and hand them to their requests."""
        for seq, index, token in zip(step.seqs, step.indices, step.sampled.read()):
            request = self._requests.get(seq.request_id)
            if request is None or request.seq is not seq:  # finished or aborted after the step was launched
                continue
            self._append_token(request, index, token)

    def _append_token(self, request: _Request, index: int, token: SampledToken) -> None:
        seq = request.seq
        count = index + 1
        if seq.grammar is not None:
            taken = seq.grammar.accept(token.token_id, seq.params.max_tokens - count)
            if taken is None:
                self._fail(seq.request_id, RuntimeError(f"the grammar rejected token {token.token_id}"))
                return
            if taken != token.token_id:  # the sampled token left no room to complete the grammar
                token = SampledToken(taken)
                # the penalties counted the sampled token on the device: recounted from the host's tokens
                self.sampler.penalties.forget(seq.request_id)
        seq.output_ids[index] = token.token_id
        reason = None
        if token.token_id in request.stop_ids:
            reason = "stop"
        elif request.text.add_token(token.token_id) or (seq.grammar is not None and seq.grammar.done):
            reason = "stop"
        elif count >= seq.params.max_tokens or seq.num_prompt_tokens + count >= self.max_model_len:
            reason = "length"
        if reason is not None and seq.grammar is not None and seq.grammar.steered:
            reason = "length"  # complete, but closed early because the budget ran out
        logprobs = None
        if seq.params.logprobs is not None:
            text_of, bytes_of = self.tokenizer.token_text, self.tokenizer.token_bytes
            top = token.top or []
            logprobs = [TokenLogprob(token.token_id, text_of(token.token_id), token.logprob,
                                     [(t, text_of(t), lp) for t, lp in top], bytes_of(token.token_id),
                                     [bytes_of(t) for t, _ in top])]
        if reason is not None:
            del seq.output_ids[count:]  # a step launched past the end produced nothing anyone will read
            # Free the blocks before the caller hears of the finish: it may look at stats() at once.
            self.scheduler.finish(seq, reason)
            self.sampler.forget(seq.request_id)
            self._requests.pop(seq.request_id, None)
        self._emit(request, [token.token_id], logprobs, reason)

    def _emit(self, request: _Request, token_ids: list[int], logprobs, reason: str | None) -> None:
        seq = request.seq
        out = RequestOutput(seq.request_id, request.text.release(final=reason is not None), token_ids, logprobs,
                            reason is not None, reason, seq.num_prompt_tokens, seq.num_output_tokens,
                            seq.num_cached_tokens)
        _deliver(request, out)

    def _finish(self, request_id: str, reason: str) -> None:
        request = self._requests.pop(request_id, None)
        if request is None:
            return
        self.scheduler.finish(request.seq, reason)
        self.sampler.forget(request_id)
        self._emit(request, [], None, reason)

    def _fail(self, request_id: str, exc: Exception) -> None:
        request = self._requests.pop(request_id, None)
        if request is None:
            return
        self.scheduler.finish(request.seq, "abort")
        self.sampler.forget(request_id)
        _deliver(request, exc if isinstance(exc, RequestCut) else RuntimeError(f"generation failed: {exc}"))


def _deliver(request: _Request, item: RequestOutput | BaseException) -> None:
    try:
        request.loop.call_soon_threadsafe(request.outputs.put_nowait, item)
    except RuntimeError:  # the caller's event loop is gone; nobody is listening any more
        pass
