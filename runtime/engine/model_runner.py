"""Runs the model for a scheduled batch: device buffers, the paged KV cache, and CUDA graphs for decode.

Start-up order (each step allocates through the logged allocator, so the order is fixed):
weights -> rope table -> static decode buffers -> KV cache -> graph pool (captured or restored graphs).
"""

from __future__ import annotations

from contextlib import nullcontext
from dataclasses import asdict, dataclass
from typing import Callable, Protocol

import torch

from runtime.cuda_driver.device import private_stream
from runtime.engine.allocator import DeviceAllocator, MemoryProvider
from runtime.engine.attention_metadata import AttentionMetadata, SplitScratch
from runtime.engine.block_manager import BlockManager
from runtime.engine.decode_inputs import DecodeBuffers, DecodeStaging
from runtime.engine.engine_config import EngineConfig
from runtime.engine.cpu.packed import MAX_TOKENS as MAX_PACKED_TOKENS
from runtime.engine.cpu.threads import ops_on_one_thread
from runtime.engine.kernels.shape_class import prefill_block_q
from runtime.engine.layers.rotary import rope_table
from runtime.engine.model_config import ModelConfig
from runtime.engine.models.llama import LlamaForCausalLM, bind_weights
from runtime.engine.scheduler import ScheduledBatch
from runtime.engine.sequence import PENDING, Sequence
from runtime.engine.weight_plan import WeightPlan, tensor_views, torch_dtype

#: a CUDA context with torch's kernels loaded (about 500 MiB on an H100), created before anything is measured
CUDA_CONTEXT_BYTES = 512 << 20
#: the attention's key parts when a step has at most SPLIT_MAX_PROGRAMS programs (tiles x KV heads): with
#: Qwen2-1.5B's two KV heads, up to 32 decode rows
SPLIT_PARTS = 8
SPLIT_MAX_PROGRAMS = 64
#: left free on the GPU beside the KV cache (fragmentation, other processes' growth)
FREE_MARGIN_BYTES = 256 << 20
#: an eager step's block table is this many entries wide, or a multiple. Triton compiles a kernel for each
#: divisibility of an integer argument (by 16, or equal to 1), and the table's row stride is one: a table only as
#: wide as the longest sequence would have the first prompt of a new length compile the attention kernel again.
#: Padded, every eager step runs the one the engine's start compiled (the zeros past a sequence's blocks are
#: never read: its length bounds its row).
TABLE_WIDTH_MULTIPLE = 16


@dataclass(frozen=True)
class KVProfile:
    """What the profiling forward found; recorded at bake time so boot can skip it."""

    num_blocks: int
    block_bytes: int
    peak_activation_bytes: int
    free_bytes_after_profile: int
    total_bytes: int

    def as_dict(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class PendingTokens:
    """The last step's sampled tokens, still on the device: the input of every sequence whose last token
    the host has not read yet (async scheduling)."""

    tokens: torch.Tensor          # [B] int64, on the device
    rows: dict[Sequence, int]     # each sequence's row in `tokens`


class Replayable(Protocol):
    def replay(self) -> None: ...


class ModelRunner:
    def __init__(self, model: LlamaForCausalLM, model_config: ModelConfig, config: EngineConfig,
                 max_model_len: int, memory: MemoryProvider | None = None) -> None:
        self.model = model
        self.model_config = model_config
        self.config = config
        self.device = torch.device(config.device)
        self.dtype = torch_dtype(config.dtype)
        self.allocator = DeviceAllocator(self.device, memory)
        self.max_model_len = max_model_len
        # on the CPU, every projection packed (runtime/engine/cpu/packed.py): steps of a few tokens then run
        # torch's ops on one thread, the packed projections on all
        self.packed_steps = False
        # prefill tiles of the attention kernel's shape class (runtime/engine/kernels/shape_class.py)
        self.prefill_block_q = prefill_block_q(model_config.num_heads // model_config.num_kv_heads)
        self.max_blocks_per_seq = -(-max_model_len // config.block_size)
        self.reserved_blocks = 1 if config.use_cuda_graphs else 0
        sizes = [bs for bs in config.cuda_graph_batch_sizes if bs <= config.max_num_seqs]
        self.graph_batch_sizes: list[int] = sorted(sizes) if config.use_cuda_graphs else []
        self.graphs: dict[int, Replayable] = {}
        self.graph_pool = None
        self._capture_stream = None
        self.kv_caches: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.num_kv_blocks = 0
        self.cos_sin: torch.Tensor | None = None
        self.weight_buffer: torch.Tensor | None = None
        self.decode: DecodeBuffers | None = None
        self.staging: DecodeStaging | None = None
        self.split_scratch: SplitScratch | None = None

    # -- allocation, in start-up order -------------------------------------------------------------

    def allocate_weights(self, plan: WeightPlan, releasable: bool = False,
                         adopt: tuple[int, int] | None = None) -> torch.Tensor:
        """The weight buffer and every parameter's view of it; ADOPT: see DeviceAllocator.alloc."""
        buffer = self.allocator.alloc("weights", plan.total_bytes, releasable, adopt)
        bind_weights(self.model, tensor_views(buffer, plan))
        self.weight_buffer = buffer
        return buffer

    def allocate_static(self, table: torch.Tensor | None = None) -> None:
        """The rotary table (TABLE: computed already, on the host), the decode graphs' buffers, the attention's
        scratch."""
        table = table if table is not None else rope_table(self.model_config, self.max_model_len)
        self.cos_sin = self.allocator.alloc_tensor("rope_cos_sin", tuple(table.shape), torch.float32)
        self.cos_sin.copy_(table)
        if self.graph_batch_sizes:
            self.decode = self._allocate_decode_buffers(max(self.graph_batch_sizes))
            self.staging = DecodeStaging(self.decode)
        if self.device.type == "cuda":
            self.split_scratch = self._allocate_split_scratch()

    def _allocate_split_scratch(self) -> SplitScratch:
        """Where the attention's key parts meet when a step has few tiles (runtime/engine/kernels/
        paged_attention.py): decode rows (16: a decode tile's query heads of one KV head, up to 16) of a head
        dimension up to 128."""
        splits, programs, rows, dim = SPLIT_PARTS, SPLIT_MAX_PROGRAMS, 16, 128
        alloc = self.allocator.alloc_tensor
        scratch = SplitScratch(splits, programs, rows, dim,
                               alloc("attention_split_ml", (programs * splits * rows * 2,), torch.float32),
                               alloc("attention_split_acc", (programs * splits * rows * dim,), torch.float32),
                               alloc("attention_split_arrivals", (programs,), torch.int32))
        scratch.arrivals.zero_()
        return scratch

    def _allocate_decode_buffers(self, max_bs: int) -> DecodeBuffers:
        alloc = self.allocator.alloc_tensor
        buffers = DecodeBuffers(
            input_ids=alloc("decode_input_ids", (max_bs,), torch.int64),
            positions=alloc("decode_positions", (max_bs,), torch.int64),
            slot_mapping=alloc("decode_slot_mapping", (max_bs,), torch.int64),
            seq_lens=alloc("decode_seq_lens", (max_bs,), torch.int32),
            block_tables=alloc("decode_block_tables", (max_bs, self.max_blocks_per_seq), torch.int32),
            arange=alloc("decode_arange", (max_bs + 1,), torch.int32),
            logits=alloc("decode_logits", (max_bs, self.model_config.vocab_size), self.dtype),
        )
        buffers.arange.copy_(torch.arange(max_bs + 1, dtype=torch.int32))
        for t in (buffers.input_ids, buffers.positions, buffers.slot_mapping, buffers.block_tables):
            t.zero_()
        buffers.seq_lens.fill_(1)
        return buffers

    @property
    def kv_block_bytes(self) -> int:
        c = self.model_config
        itemsize = torch.empty((), dtype=self.dtype).element_size()
        return c.num_layers * 2 * self.config.block_size * c.num_kv_heads * c.head_dim * itemsize

    def allocate_kv(self, num_blocks: int, releasable: bool = False) -> None:
        c = self.model_config
        shape = (c.num_layers, 2, num_blocks, self.config.block_size, c.num_kv_heads, c.head_dim)
        kv = self.allocator.alloc_tensor("kv_cache", shape, self.dtype, releasable)
        self.kv_caches = [(kv[i, 0], kv[i, 1]) for i in range(c.num_layers)]
        self.num_kv_blocks = num_blocks

    def cpu_kv_blocks(self) -> int:
        fit = self.config.cpu_kv_cache_bytes // self.kv_block_bytes
        wanted = self.config.max_num_seqs * self.max_blocks_per_seq
        return int(max(self.max_blocks_per_seq, min(fit, wanted)))

    # -- profiling and graphs (cuda) ---------------------------------------------------------------

    @torch.inference_mode()
    def profile_kv_blocks(self) -> KVProfile:
        """Run the largest step the scheduler may produce and size the KV cache from what is left."""
        tokens = max(self.config.max_num_batched_tokens, self.max_model_len)
        num_seqs = min(self.config.max_num_seqs, tokens)
        lengths = [tokens // num_seqs + (1 if i < tokens % num_seqs else 0) for i in range(num_seqs)]
        lengths = [min(n, self.max_model_len) for n in lengths]
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        blocks = sum(-(-n // self.config.block_size) for n in lengths)
        c = self.model_config
        scratch = torch.empty((c.num_layers, 2, blocks, self.config.block_size, c.num_kv_heads, c.head_dim),
                              dtype=self.dtype, device=self.device)
        saved, self.kv_caches = self.kv_caches, [(scratch[i, 0], scratch[i, 1]) for i in range(c.num_layers)]
        try:
            tables, first = [], 0
            for n in lengths:
                count = -(-n // self.config.block_size)
                tables.append(list(range(first, first + count)))
                first += count
            logits = self._forward_eager(
                [0] * sum(lengths), [p for n in lengths for p in range(n)],
                [t[p // self.config.block_size] * self.config.block_size + p % self.config.block_size
                 for t, n in zip(tables, lengths) for p in range(n)],
                lengths, [n for n in lengths], tables)
            torch.softmax(logits.float(), dim=-1)
            from runtime.engine.kernels.sampling import greedy_with_logprob

            greedy_with_logprob(logits)  # compiled here, in the start whose Triton cache faas-build bakes
            torch.cuda.synchronize()
            peak = torch.cuda.max_memory_allocated() - before - scratch.numel() * scratch.element_size()
        finally:
            self.kv_caches = saved
            del scratch
        torch.cuda.empty_cache()
        free, total = torch.cuda.mem_get_info()
        # GPU_MEMORY_UTILIZATION is this engine's share of the GPU, charged with what the engine itself holds:
        # torch's reserve, its buffers mapped through the driver, its context. What other processes use (other
        # instances starting beside it, growing while it starts) is not, but the cache must still fit in
        # what is free now.
        reserved = torch.cuda.memory_reserved()
        own_non_torch = CUDA_CONTEXT_BYTES + self.allocator.driver_bytes
        budget = total * self.config.gpu_memory_utilization - reserved - own_non_torch - peak
        budget = min(budget, free - peak - FREE_MARGIN_BYTES)
        num_blocks = int(budget // self.kv_block_bytes)
        if num_blocks < self.max_blocks_per_seq + self.reserved_blocks:
            raise RuntimeError(f"not enough GPU memory for the KV cache of one {self.max_model_len}-token sequence "
                               f"({num_blocks} blocks fit); lower MAX_MODEL_LEN or raise GPU_MEMORY_UTILIZATION")
        return KVProfile(num_blocks, self.kv_block_bytes, int(peak), int(free), int(total))

    @property
    def capture_stream(self) -> torch.cuda.Stream:
        """This runner's own stream for its captures (runtime/cuda_driver/device.py says why not a pooled one)."""
        if self._capture_stream is None:
            self._capture_stream = private_stream(self.device)
        return self._capture_stream

    @torch.inference_mode()
    def capture_graphs(self, keep_graphs: bool = False,
                       on_captured: Callable[[int, torch.cuda.CUDAGraph], None] | None = None,
                       sizes: list[int] | None = None) -> None:
        """Capture one decode graph per batch size (`sizes`, default all), largest first, all sharing one
        memory pool. `keep_graphs` keeps each graph's description readable (for materialisation)."""
        from runtime.engine.kernels import dependent_launch  # Triton: imported on the GPU only
        from runtime.engine.kernels.gemv import MAX_FEW_ROWS

        link = dependent_launch.supported(self.device)
        for bs in sorted(self.graph_batch_sizes if sizes is None else sizes, reverse=True):
            self._graph_forward(bs)  # warm-up: cuBLAS and Triton set themselves up outside the capture
            early = link and bs <= MAX_FEW_ROWS  # steps whose projections are the engine's own kernels
            graph = self._capture(bs, keep_graphs or link, early)
            if link:
                linked = dependent_launch.link_engine_kernels(graph.raw_cuda_graph())
                if early and linked.library_kernels:  # a projection went to cuBLAS after all
                    graph = self._capture(bs, True, False)
                    dependent_launch.link_engine_kernels(graph.raw_cuda_graph())
            if keep_graphs or link:  # kept past the capture: its edges are read or rewritten first
                graph.instantiate()
            self.graph_pool = graph.pool()
            self.graphs[bs] = graph
            if on_captured is not None:
                on_captured(bs, graph)
        torch.cuda.synchronize()

    def _capture(self, bs: int, keep: bool, early: bool) -> torch.cuda.CUDAGraph:
        from runtime.engine.kernels.dependent_launch import early_start

        graph = torch.cuda.CUDAGraph(keep_graph=keep)
        # thread_local: the weight loader's threads may still be streaming (materialised start), and a global
        # capture would fail their pinned allocations and event waits
        with early_start(early), torch.cuda.graph(graph, pool=self.graph_pool, stream=self.capture_stream,
                                                  capture_error_mode="thread_local"):
            self._graph_forward(bs)
        return graph

    def _graph_forward(self, bs: int) -> None:
        d = self.decode
        meta = AttentionMetadata(
            slot_mapping=d.slot_mapping[:bs], query_start_loc=d.arange[:bs + 1], seq_lens=d.seq_lens[:bs],
            block_tables=d.block_tables[:bs], tile_seq=d.arange[:bs], tile_q_start=d.arange[:bs], block_q=1,
            split=self.split_scratch)
        hidden = self.model(d.input_ids[:bs], d.positions[:bs], meta, self.kv_caches, self.cos_sin)
        self.model.compute_logits(hidden, out=d.logits[:bs])

    @torch.inference_mode()
    def run_first_layers(self, batch_size: int, num_layers: int = 1) -> None:
        """An eager decode step through the first layers only: loads the kernel modules a full step at this
        batch size uses. Its inputs are its own, shaped like the graphs' (so Triton picks the same
        specialisations), its keys and values go to the reserved block and its logits to scratch: it may run
        while the engine serves (materialised graphs restored after ready)."""
        d = self.decode
        tables = torch.zeros_like(d.block_tables[:batch_size])
        meta = AttentionMetadata(
            slot_mapping=torch.zeros_like(d.slot_mapping[:batch_size]), query_start_loc=d.arange[:batch_size + 1],
            seq_lens=torch.ones_like(d.seq_lens[:batch_size]), block_tables=tables,
            tile_seq=d.arange[:batch_size], tile_q_start=d.arange[:batch_size], block_q=1, split=self.split_scratch)
        ids = torch.zeros_like(d.input_ids[:batch_size])
        hidden = self.model(ids, torch.zeros_like(ids), meta, self.kv_caches, self.cos_sin, num_layers=num_layers)
        self.model.compute_logits(hidden, out=torch.empty_like(d.logits[:batch_size]))

    # -- execution ---------------------------------------------------------------------------------

    @torch.inference_mode()
    def execute(self, batch: ScheduledBatch, blocks: BlockManager,
                pending: PendingTokens | None = None) -> torch.Tensor:
        """Logits of the next token of every scheduled sequence that samples one (`batch.samples`: not those
        whose slice of a prompt stops short of its end), [sampling sequences, vocab]. A sequence whose last
        token is PENDING takes it from `pending` on the device."""
        if batch.is_decode:
            graph_bs = self._graph_size(len(batch.seqs))
            if graph_bs is not None:
                return self._forward_graph(graph_bs, batch.seqs, blocks, pending)
        elif batch.num_tokens <= self.config.graph_prefill_tokens and batch.continues_every_prompt:
            graph_bs = self._graph_size(batch.num_tokens)
            if graph_bs is not None:
                return self._forward_graph_rows(graph_bs, batch, blocks, pending)
        ids, positions, slots, query_lens, seq_lens, tables, feeds = [], [], [], [], [], [], []
        for seq, n, sample in zip(batch.seqs, batch.num_new_tokens, batch.samples):
            start = seq.num_computed_tokens
            if seq.last_token == PENDING:
                assert n == 1, "only a decoding sequence runs ahead of its last token"
                feeds.append((len(ids), pending.rows[seq]))
                ids.append(0)
            else:
                ids.extend([seq.last_token] if n == 1 and sample else seq.tokens_between(start, start + n))
            positions.extend(range(start, start + n))
            slots.extend(blocks.slot(seq, p) for p in range(start, start + n))
            query_lens.append(n)
            seq_lens.append(start + n)
            tables.append(seq.block_table)
        return self._forward_eager(ids, positions, slots, query_lens, seq_lens, tables,
                                   lambda ids_on_device: _feed_pending(ids_on_device, feeds, pending),
                                   batch.samples)

    def _graph_size(self, n: int) -> int | None:
        for bs in self.graph_batch_sizes:
            if bs >= n and bs in self.graphs:
                return bs
        return None

    def _forward_graph(self, bs: int, seqs: list[Sequence], blocks: BlockManager,
                       pending: PendingTokens | None) -> torch.Tensor:
        positions = [seq.num_computed_tokens for seq in seqs]
        ids, feeds = [], []
        for i, seq in enumerate(seqs):
            token = seq.last_token
            if token == PENDING:
                feeds.append((i, pending.rows[seq]))
                token = 0
            ids.append(token)
        self._replay(bs, ids, positions, [blocks.slot(seq, p) for seq, p in zip(seqs, positions)],
                     [seq.block_table for seq in seqs], feeds, pending)
        return self.decode.logits[:len(seqs)]

    def _forward_graph_rows(self, bs: int, batch: ScheduledBatch, blocks: BlockManager,
                            pending: PendingTokens | None) -> torch.Tensor:
        """A step with prompt tokens in it, in a decode graph: each new token is a row of its own, attending
        to its sequence's tokens up to itself. A layer stores every row's key and value before any row
        attends, so a row sees the rows before it as cached tokens: the causal attention of a prefill. An
        eager step pays the host's launch of every kernel (17 ms for Llama-3-8B on the H100), far more than
        the device needs for a few dozen tokens: the suffix after a cached prefix, a prompt's last slice."""
        rows = graph_rows(batch, blocks, pending)
        self._replay(bs, rows.ids, rows.positions, rows.slots, rows.tables, rows.feeds, pending)
        if not rows.sampling:
            return self.decode.logits[:0]
        return self.decode.logits[self._upload(rows.sampling, torch.int64)]

    def _replay(self, bs: int, ids: list[int], positions: list[int], slots: list[int], tables: list[list[int]],
                feeds: list[tuple[int, int]], pending: PendingTokens | None) -> None:
        """Stage one token a row in the decode buffers, take the PENDING ones from the device, replay graph BS."""
        self.staging.fill(bs, ids, positions, slots, tables)
        self.staging.upload(bs)
        _feed_pending(self.decode.input_ids, feeds, pending)
        self.graphs[bs].replay()

    def _forward_eager(self, ids, positions, slots, query_lens, seq_lens, tables,
                       feed: Callable[[torch.Tensor], None] | None = None,
                       samples: list[bool] | None = None) -> torch.Tensor:
        starts = [0]
        for n in query_lens:
            starts.append(starts[-1] + n)
        block_q = 1 if max(query_lens) == 1 else self.prefill_block_q
        tile_seq, tile_start = [], []
        for i, n in enumerate(query_lens):
            for s in range(starts[i], starts[i + 1], block_q):
                tile_seq.append(i)
                tile_start.append(s)
        width = -(-max(len(t) for t in tables) // TABLE_WIDTH_MULTIPLE) * TABLE_WIDTH_MULTIPLE
        upload = self._upload
        meta = AttentionMetadata(
            slot_mapping=upload(slots, torch.int64), query_start_loc=upload(starts, torch.int32),
            seq_lens=upload(seq_lens, torch.int32),
            block_tables=upload([row + [0] * (width - len(row)) for row in tables], torch.int32),
            tile_seq=upload(tile_seq, torch.int32), tile_q_start=upload(tile_start, torch.int32),
            block_q=block_q, query_start_loc_cpu=starts, seq_lens_cpu=list(seq_lens), split=self.split_scratch)
        ids_on_device = upload(ids, torch.int64)
        if feed is not None:
            feed(ids_on_device)
        last = [end - 1 for i, end in enumerate(starts[1:]) if samples is None or samples[i]]
        with ops_on_one_thread() if self.packed_steps and len(ids) <= MAX_PACKED_TOKENS else nullcontext():
            hidden = self.model(ids_on_device, upload(positions, torch.int64), meta, self.kv_caches, self.cos_sin)
            if not last:  # only slices short of their prompts' ends: no logits wanted
                return hidden[:0]
            if last[-1] - last[0] == len(last) - 1:  # consecutive rows (one prompt's last): a view, where an
                # index would launch one of torch's kernels, whose module a restored process loads at its
                # first request
                return self.model.compute_logits(hidden[last[0]:last[-1] + 1])
            return self.model.compute_logits(hidden[upload(last, torch.int64)])

    def _upload(self, values: list, dtype: torch.dtype) -> torch.Tensor:
        # Pageable on purpose: pinning a fresh host tensor per input made the eager 8B decode step 47% slower
        # and Qwen2-1.5B's 4x slower on the H100 (bench_decode); the graph path has its own pinned staging.
        return torch.tensor(values, dtype=dtype).to(self.device, non_blocking=True)


def _feed_pending(ids: torch.Tensor, feeds: list[tuple[int, int]], pending: PendingTokens | None) -> None:
    """Write the pending tokens into the step's input ids on the device: row `dst` of `ids` gets row `src`
    of `pending.tokens`, for each (dst, src) of `feeds`."""
    if not feeds:
        return
    n = len(feeds)
    if all(dst == src == i for i, (dst, src) in enumerate(feeds)):  # the same batch as last step: one copy
        ids[:n].copy_(pending.tokens[:n])
        return
    index = torch.tensor(feeds, dtype=torch.int64).to(ids.device, non_blocking=True)
    ids[index[:, 0]] = pending.tokens[index[:, 1]]


@dataclass
class GraphRows:
    """A step laid out one token per row of a decode graph."""

    ids: list[int]
    positions: list[int]
    slots: list[int]
    tables: list[list[int]]               # each row's sequence's block table
    feeds: list[tuple[int, int]]          # (row, row of the pending tokens) of a PENDING last token
    sampling: list[int]                   # the row of each sampling sequence's last token, in batch order


def graph_rows(batch: ScheduledBatch, blocks: BlockManager, pending: PendingTokens | None) -> GraphRows:
    rows = GraphRows([], [], [], [], [], [])
    for seq, n, sample in zip(batch.seqs, batch.num_new_tokens, batch.samples):
        start = seq.num_computed_tokens
        if n == 1 and seq.last_token == PENDING:
            rows.feeds.append((len(rows.ids), pending.rows[seq]))
            rows.ids.append(0)
        else:
            rows.ids.extend([seq.last_token] if n == 1 and sample else seq.tokens_between(start, start + n))
        rows.positions.extend(range(start, start + n))
        rows.slots.extend(blocks.slot(seq, p) for p in range(start, start + n))
        rows.tables.extend([seq.block_table] * n)
        if sample:
            rows.sampling.append(len(rows.ids) - 1)
    return rows
