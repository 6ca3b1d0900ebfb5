"""The engine's own knobs, derived from the runtime settings (runtime/config.py) by the bootstrap."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

#: the decode batch sizes vLLM captures CUDA graphs for: 1, 2, 4 and every multiple of 8 up to 256
CUDA_GRAPH_BATCH_SIZES = (1, 2, 4) + tuple(range(8, 257, 8))


@dataclass(frozen=True)
class EngineConfig:
    device: str = "cpu"                 # "cpu" or "cuda" (already resolved, never "auto")
    dtype: str = "float32"              # float32, bfloat16 or float16
    max_model_len: int | None = None    # None: the model's own, at most 4096
    max_num_seqs: int = 16
    max_num_batched_tokens: int = 2048  # a step's tokens: decodes first, then slices of prompts
    block_size: int = 16
    gpu_memory_utilization: float = 0.9
    num_kv_blocks: int | None = None    # a fixed KV budget in blocks (None: profile on cuda, size by memory on cpu)
    cpu_kv_cache_bytes: int = 1 << 30   # KV budget on cpu when num_kv_blocks is None
    enforce_eager: bool = False
    async_scheduling: bool = True       # launch each step before reading the last one's tokens
    enable_prefix_caching: bool = True  # reuse the KV blocks of a prefix computed before
    cuda_graph_batch_sizes: tuple[int, ...] = field(default=CUDA_GRAPH_BATCH_SIZES)
    graph_prefill_tokens: int = 64      # a step with prompt tokens and at most this many runs in a decode graph
    seed: int = 0
    cpu_threads: int | None = None      # torch's threads on cpu (None: the CPUs the cgroup's quota allows)
    cpu_packed_weights: bool = True     # on cpu, weights that are exactly 4/8-bit groups also kept packed

    def as_dict(self) -> dict:
        return asdict(self)

    @property
    def on_cuda(self) -> bool:
        """`cuda` (the current GPU) or `cuda:N` (GPU N: a several-model instance gives each GPU its engines)."""
        return self.device.split(":")[0] == "cuda"

    @property
    def use_cuda_graphs(self) -> bool:
        return self.on_cuda and not self.enforce_eager
