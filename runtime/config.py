"""The one settings object: every knob of the runtime, read from environment variables or flags.

Each field names its environment variable; `faas-bootstrap` has a matching `--flag` for each. Values are
parsed and checked here, so a bad value fails at start with a one-line reason instead of deep inside.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

from runtime.setting_text import EARLY_DEFAULTS, FALSE_WORDS, TRUE_WORDS
from runtime.weights.prefetch import READERS as PREFETCH_READERS
from runtime.weights.prefetch import RESTORE_READERS as PREFETCH_RESTORE_READERS
from runtime.weights.prefetch import TABLE_READERS as PREFETCH_TABLE_READERS


class ConfigError(ValueError):
    """A setting is missing, unknown or has an invalid value. The message is one line."""


def _positive_int(text: str) -> int:
    value = int(text)
    if value <= 0:
        raise ValueError("must be a positive integer")
    return value


def _non_negative_int(text: str) -> int:
    value = int(text)
    if value < 0:
        raise ValueError("must be an integer >= 0")
    return value


def _optional_positive_int(text: str) -> int | None:
    return None if text in ("", "auto") else _positive_int(text)


def _fraction(text: str) -> float:
    value = float(text)
    if not 0.0 < value <= 1.0:  # NaN fails this too
        raise ValueError("must be in (0, 1]")
    return value


def _positive_float(text: str) -> float:
    value = float(text)
    if not (math.isfinite(value) and value > 0):
        raise ValueError("must be a positive number")
    return value


def _optional_positive_float(text: str) -> float | None:
    return None if text in ("", "auto") else _positive_float(text)


def _non_negative_float(text: str) -> float:
    value = float(text)
    if not (math.isfinite(value) and value >= 0):
        raise ValueError("must be a number >= 0")
    return value


def _part_mb(text: str) -> float:
    value = _positive_float(text)
    if value * 2**20 < 1024:
        raise ValueError("must be at least 1 KiB (0.001)")
    return value


def _choice(*allowed: str) -> Callable[[str], str]:
    def parse(text: str) -> str:
        value = text.strip().lower()
        if value not in allowed:
            raise ValueError(f"must be one of {', '.join(allowed)}")
        return value

    return parse


def _bool(text: str) -> bool:
    value = text.strip().lower()
    if value in TRUE_WORDS:
        return True
    if value in FALSE_WORDS:
        return False
    raise ValueError("must be true or false")


def _auto_or_bool(text: str) -> str:
    """auto, always, never, or a boolean as always / never."""
    value = text.strip().lower()
    if value in ("auto", "always", "never"):
        return value
    try:
        return "always" if _bool(value) else "never"
    except ValueError:
        raise ValueError("must be auto, 1 or 0") from None


def _optional_path(text: str) -> Path | None:
    return Path(text).expanduser() if text else None


def _optional_str(text: str) -> str | None:
    return text or None


def _api_key(text: str) -> str:
    # An empty key would silently leave /v1 open: a deployment that meant to set one must not start.
    if not text.strip():
        raise ValueError("must not be empty (unset API_KEY to serve without a key)")
    return text


def _port(text: str) -> int:
    value = int(text)
    if not 0 <= value < 65536:
        raise ValueError("must be a TCP port (0-65535)")
    return value


@dataclass(frozen=True)
class ModelRef:
    """One model of MODEL: the name clients call it by (None: derived from the reference, as for a lone
    model) and where it comes from (None: the embedded model)."""

    name: str | None
    ref: str | None


#: a model name in a MODEL list: what a client puts in a request's `model` and a label of /metrics
_MODEL_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")
#: the reference of the embedded model in a MODEL list (a lone model gets it by leaving MODEL unset)
EMBEDDED_REF = "embedded"


def model_refs(text: str | None) -> tuple[ModelRef, ...]:
    """MODEL -> its models. A lone reference is one unnamed model; `name=reference[,name=reference...]`
    names each (a lone model too). Raises ValueError (a "must" sentence) for a malformed list."""
    if not text:
        return (ModelRef(None, None),)
    head = text.split(",", 1)[0].partition("=")[0]
    if "," not in text and not ("=" in text and _MODEL_NAME.fullmatch(head)):
        return (ModelRef(None, text),)
    models: dict[str, ModelRef] = {}
    for i, entry in enumerate(text.split(","), 1):
        name, sep, ref = (part.strip() for part in entry.partition("="))
        if not entry.strip():
            raise ValueError(f"entry {i} is empty: MODEL must be name=reference pairs separated by commas")
        if not sep:
            raise ValueError(f"entry {entry.strip()!r} must be name=reference")
        if not _MODEL_NAME.fullmatch(name):
            raise ValueError(f"model name {name!r} must be 1-64 letters, digits, '.', '_' or '-' (not first)")
        if not ref:
            raise ValueError(f"model {name!r} must have a reference after '=' ({EMBEDDED_REF} for the embedded one)")
        if name in models:
            raise ValueError(f"model name {name!r} must appear once, not twice")
        models[name] = ModelRef(name, None if ref == EMBEDDED_REF else ref)
    return tuple(models.values())


def _model_list(text: str) -> str | None:
    model_refs(text)  # checked here, parsed where used
    return text or None


def _setting(env: str, parse: Callable[[str], Any], default: Any, help: str) -> Any:
    return field(default=default, metadata={"env": env, "parse": parse, "help": help})


def _default_cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "thawllm"


@dataclass(frozen=True)
class Settings:
    model: str | None = _setting(
        "MODEL", _model_list, None,
        "model directory, GGUF file, faas-build layout or s3:// prefix; unset serves the embedded SmolLM2; "
        "several models: name=reference pairs separated by commas (docs/multi-model.md)")
    port: int = _setting("PORT", _port, 8080, "TCP port to listen on")
    host: str = _setting("HOST", str, "0.0.0.0", "address to listen on")
    device: str = _setting("DEVICE", _choice("auto", "cpu", "cuda"), "auto", "auto, cpu or cuda")
    dtype: str = _setting(
        "DTYPE", _choice("auto", "float32", "bfloat16", "float16"), "auto",
        "weights and activations dtype; auto is bfloat16 on cuda, float32 on cpu")
    cpu_threads: int | None = _setting(
        "CPU_THREADS", _optional_positive_int, None,
        "torch threads on cpu (default: the CPUs the cgroup's CPU quota and affinity allow)")
    cpu_packed_weights: bool = _setting(
        "CPU_PACKED_WEIGHTS", _bool, True,
        "on cpu, decode steps read weights that are exactly 4/8-bit groups (GGUF Q4_1, Q8_0) packed; lossless")
    snapshot_dir: Path | None = _setting(
        "SNAPSHOT_DIR", _optional_path, None, "where faas-build wrote the snapshots (unset: none)")
    cache_dir: Path = _setting(
        "CACHE_DIR", lambda t: Path(t).expanduser(), _default_cache_dir(),
        "local disk cache for weights and the imported embedded model")
    cache_max_gb: float = _setting("CACHE_MAX_GB", _positive_float, 100.0, "disk cache size bound (GiB)")
    s3_concurrency: int = _setting(
        "S3_CONCURRENCY", _positive_int, 16, "S3 ranged GETs (and multipart upload parts) in flight")
    s3_part_mb: float = _setting(
        "S3_PART_MB", _part_mb, 16.0, "size of one S3 ranged GET or multipart upload part (MiB)")
    api_key: str | None = _setting(
        "API_KEY", _api_key, None, "require this bearer token (unset: open; an empty value is refused)")
    max_model_len: int | None = _setting(
        "MAX_MODEL_LEN", _optional_positive_int, None, "context length (default: the model's, at most 4096)")
    max_num_seqs: int | None = _setting(
        "MAX_NUM_SEQS", _optional_positive_int, None, "most sequences in a batch (default 256 cuda, 16 cpu)")
    max_num_batched_tokens: int | None = _setting(
        "MAX_NUM_BATCHED_TOKENS", _optional_positive_int, None,
        "most tokens in one step; longer prompts are prefilled in slices beside the decodes (default 2048 cuda, "
        "4096 cpu)")
    gpu_memory_utilization: float = _setting(
        "GPU_MEMORY_UTILIZATION", _fraction, 0.90, "share of GPU memory the engine may use")
    pool_memory_gb: float | None = _setting(
        "POOL_MEMORY_GB", _optional_positive_float, None,
        "several models on the host (cpu): the memory their weights and KV caches share (GiB); on cuda "
        "GPU_MEMORY_UTILIZATION bounds the pool")
    pool_eviction: str = _setting(
        "POOL_EVICTION", _choice("cost", "lru"), "cost",
        "several models: which retained weights go when the pool is short: cost (reload time weighted by "
        "request rate, per weight group) or lru (whole models, least recently used first)")
    pool_kernels: str = _setting(
        "POOL_KERNELS", _choice("beside", "after"), "after",
        "several models on cuda: a model's first activation without baked graphs loads its kernels (captures "
        "its decode graphs) after its weight stream, as a lone model's cold start does, or beside it (slower "
        "on the H100: the module loads wait behind the weight copies)")
    enforce_eager: bool = _setting("ENFORCE_EAGER", _bool, False, "never use CUDA graphs")
    enable_prefix_caching: bool = _setting(
        "ENABLE_PREFIX_CACHING", _bool, True,
        "reuse the KV cache of a prompt's longest prefix computed before (off: every prompt computed whole)")
    graph_prefill_tokens: int = _setting(
        "GRAPH_PREFILL_TOKENS", _non_negative_int, 64,
        "a step with prompt tokens and at most this many tokens in all runs in a decode CUDA graph, a token "
        "a row, when every prompt in it goes on from computed tokens (after a cached prefix, a later slice); "
        "0: such steps run eagerly")
    async_scheduling: bool = _setting(
        "ASYNC_SCHEDULING", _bool, True,
        "launch each decode step before reading the last one's tokens (off: one step at a time)")
    graphs_before_ready: int = _setting(
        "GRAPHS_BEFORE_READY", _positive_int, 1,
        "materialized restores: the largest decode batch size whose CUDA graph is rebuilt before the server is "
        "ready; larger ones are rebuilt in the background right after, and a batch that finds its graph not "
        "rebuilt yet runs on a larger one or eagerly (256: every graph before ready)")
    gpu_snapshot_weights: str = _setting(
        "GPU_SNAPSHOT_WEIGHTS", _choice("stream", "image"), "stream",
        "faas-build gpu snapshots: stream (weights and KV cache left out of the image, weights streamed back "
        "after restore) or image (all GPU memory in the image)")
    gpu_snapshot_warm_up: bool = _setting(
        "GPU_SNAPSHOT_WARM_UP", _bool, True,
        "faas-build gpu snapshots: serve a few throwaway requests before the checkpoint, so that a first greedy "
        "or sampled request after a restore finds its kernels loaded (0: checkpoint straight after the start)")
    weights_during_restore: str = _setting(
        "WEIGHTS_DURING_RESTORE", _auto_or_bool, "auto",
        "who streams the weights of a CRIU restore (gpu snapshots baked with GPU_SNAPSHOT_WEIGHTS=stream, process "
        "snapshots on cuda): auto (a helper process, while CRIU restores the runtime; for a process snapshot "
        "only when they are not in the page cache), 1 (the helper, always) or 0 (the restored runtime, after "
        "its restore)")
    weights_memory_first: bool = _setting(
        "WEIGHTS_MEMORY_FIRST", _bool, True,
        "a helper streaming the weights during a restore hands its device memory over before the stream: the "
        "restored runtime maps it and sets its KV cache and graphs up while the weights arrive, and serves once "
        "they all have (0: the memory comes with the stream's report, and the set-up after it)")
    embedding_last: bool = _setting(
        "EMBEDDING_LAST", _bool, EARLY_DEFAULTS["EMBEDDING_LAST"],
        "a process restore whose weights a helper streams leaves the input embedding table's whole chunks for "
        "last (a layout with block digests, a table not tied to the output): the runtime serves once the other "
        "weights are in, reading the rows its steps need from the layout, each block checked, until the rest "
        "of the table has come (0: every weight before serving)")
    prime_driver: bool = _setting(
        "PRIME_DRIVER", _bool, EARLY_DEFAULTS["PRIME_DRIVER"],
        "process snapshots on cuda: a short-lived process, started right after CRIU, runs cuInit while CRIU "
        "restores the runtime, so that the restored runtime's own finds the driver warm (0: the runtime "
        "initialises CUDA alone)")
    early_restore: bool = _setting(
        "EARLY_RESTORE", _bool, EARLY_DEFAULTS["EARLY_RESTORE"],
        "faas-bootstrap starts restoring the CRIU snapshot it would restore first before importing the rest of "
        "the runtime, whose checks then take that restore over or undo it (0: CRIU starts after the checks)")
    prefetch_weights: bool = _setting(
        "PREFETCH_WEIGHTS", _bool, EARLY_DEFAULTS["PREFETCH_WEIGHTS"],
        "faas-bootstrap reads a local layout's weight files into the page cache from its first instruction, "
        "when they are not there and fit in the memory available, so that whoever streams them finds them there "
        "(0: only whoever streams them reads them)")
    prefetch_readers: int = _setting(
        "PREFETCH_READERS", _positive_int, PREFETCH_READERS,
        "threads the weights' prefetch reads with at once (a disk's best parallel read rate differs: faas-bench "
        "coldstart --page-cache dropped measures 8 and 16 beside the starts)")
    prefetch_restore_readers: int = _setting(
        "PREFETCH_RESTORE_READERS", _positive_int, PREFETCH_RESTORE_READERS,
        "threads of the PREFETCH_READERS the weights' prefetch reads with until the CRIU restore faas-bootstrap "
        "began has handed over (fewer large reads ahead of the restore's own small ones in the disk's queue)")
    prefetch_table_readers: int = _setting(
        "PREFETCH_TABLE_READERS", _positive_int, PREFETCH_TABLE_READERS,
        "threads of the PREFETCH_READERS that read the embedding table's chunks, last of a restore that serves "
        "before they are in (EMBEDDING_LAST): the rows its steps read meanwhile wait behind fewer large reads")
    prefetch_start_pages: bool = _setting(
        "PREFETCH_START_PAGES", _bool, EARLY_DEFAULTS["PREFETCH_START_PAGES"],
        "faas-bootstrap reads the file pages faas-build saw a start from the CRIU snapshot touch (its libraries' "
        "pages) into the page cache from its first instruction, before the weights' prefetch, when they are not "
        "there (0: the restored runtime faults them in, each read around by the kernel)")
    lazy_pages: bool = _setting(
        "LAZY_PAGES", _bool, EARLY_DEFAULTS["LAZY_PAGES"],
        "process snapshots: the restored runtime runs before its memory is all back; a criu lazy-pages daemon "
        "copies the rest in behind it and serves its page faults first (userfaultfd; without it, a plain "
        "restore); 0: criu restores all of the memory before the runtime runs")
    criu_feature_cache: bool = _setting(
        "CRIU_FEATURE_CACHE", _bool, EARLY_DEFAULTS["CRIU_FEATURE_CACHE"],
        "CRIU restores: criu is handed the record of the kernel's features faas-build took, where it describes "
        "this machine, instead of probing them at its start (0: criu probes them, as it does without a record)")
    handler: str = _setting(
        "HANDLER", str, "handlers.openai:handler", "module:attribute of the handler to serve")
    served_model_name: str | None = _setting(
        "SERVED_MODEL_NAME", _optional_str, None, "model name clients use (default: derived from MODEL)")
    restore: str = _setting(
        "RESTORE", _choice("auto", "gpu", "process", "materialized", "cold"), "auto",
        "restore path: auto takes the fastest that matches; others force one (falling back when absent)")
    lambda_invoke_mode: str = _setting(
        "LAMBDA_INVOKE_MODE", _choice("buffered", "response_stream"), "buffered",
        "on AWS Lambda: how HTTP responses go back; match the Function URL's InvokeMode")
    max_request_mb: float = _setting(
        "MAX_REQUEST_MB", _positive_float, 8.0, "largest request body accepted (MiB); larger ones get a 413")
    shutdown_grace_s: float = _setting(
        "SHUTDOWN_GRACE_S", _non_negative_float, 30.0, "on SIGTERM, how long in-flight requests may finish")
    placement: str = _setting(
        "PLACEMENT", _choice("affinity", "round-robin", "fixed"), "affinity",
        "several models on several devices: affinity (the device where a request starts soonest: the bytes of "
        "its model missing there and the device's queue), round-robin, or fixed (each model on one device)")
    pool_cpu_devices: int = _setting(
        "POOL_CPU_DEVICES", _positive_int, 1,
        "several models on cpu: host memory pools standing for that many GPUs (tests and benchmarks of PLACEMENT)")
    log_level: str = _setting(
        "LOG_LEVEL", _choice("debug", "info", "warning", "error"), "info", "debug, info, warning or error")
    profile_start: Path | None = _setting(
        "PROFILE_START", _optional_path, None,
        "a folder: each start writes there a sampled profile of its threads' stacks until its first token "
        "(scripts/read_start_profile.py prints it; the sampling slows the start it profiles)")

    @classmethod
    def fields(cls) -> list[dataclasses.Field]:
        return list(dataclasses.fields(cls))

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> "Settings":
        environ = os.environ if environ is None else environ
        values = {}
        for f in cls.fields():
            env = f.metadata["env"]
            if env in environ:
                values[f.name] = _parse(f, environ[env], env)
        return cls(**values).checked()

    @classmethod
    def from_args(cls, argv: Sequence[str] | None, environ: Mapping[str, str] | None = None,
                  prog: str = "faas-bootstrap") -> "Settings":
        """Environment first, then flags on top. Raises ConfigError (argparse's exit is turned off)."""
        parser = cls.argument_parser(prog)
        try:
            namespace, extra = parser.parse_known_args(argv)
        except SystemExit as exc:  # argparse prints its own message for --help
            raise ConfigError("bad command line") from exc
        if extra:
            raise ConfigError(f"unknown argument {extra[0]!r} (see {prog} --help)")
        settings = cls.from_env(environ)
        overrides = {}
        for f in cls.fields():
            text = getattr(namespace, f.name)
            if text is not None:
                overrides[f.name] = _parse(f, text, "--" + f.name.replace("_", "-"))
        return dataclasses.replace(settings, **overrides).checked()

    @classmethod
    def argument_parser(cls, prog: str) -> argparse.ArgumentParser:
        parser = argparse.ArgumentParser(prog=prog, description="Start the thawllm function runtime.")
        for f in cls.fields():
            parser.add_argument("--" + f.name.replace("_", "-"), dest=f.name, default=None,
                                help=f"{f.metadata['help']} [env {f.metadata['env']}]")
        return parser

    def replace(self, **changes: Any) -> "Settings":
        return dataclasses.replace(self, **changes)

    @property
    def models(self) -> tuple[ModelRef, ...]:
        """The models this instance serves: one, or several (a MODEL list)."""
        return model_refs(self.model)

    def for_model(self, model: ModelRef) -> "Settings":
        """The settings one model of a MODEL list starts with: as if it were served alone."""
        return self.replace(model=model.ref, served_model_name=model.name)

    def checked(self) -> "Settings":
        """Checks across settings; a lone named model (MODEL=name=reference) becomes MODEL=reference with
        that name served, so that it takes exactly the path of any lone model."""
        models = self.models
        if any(m.name for m in models) and self.served_model_name:
            raise ConfigError("SERVED_MODEL_NAME must be unset when MODEL names its models (name=reference)")
        if len(models) == 1 and models[0].name:
            return self.for_model(models[0])
        return self


def _parse(f: dataclasses.Field, text: str, source: str) -> Any:
    try:
        return f.metadata["parse"](text)
    except ValueError as exc:
        reason = str(exc) if "must" in str(exc) else f"must be a valid {f.name.replace('_', ' ')}"
        raise ConfigError(f"{source}={text!r}: {reason}") from None
