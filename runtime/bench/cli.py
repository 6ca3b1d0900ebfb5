"""faas-bench: measure cold starts and load. `faas-bench coldstart --help`, `faas-bench trace --help`,
`faas-bench switch --help` (several models in one instance)."""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import os
import signal
import sys
from pathlib import Path
from typing import Any, Coroutine, Sequence

from runtime.bench import BenchError
from runtime.bench.records import ALL_MODES, FIRST_KERNELS, SERVER_MODES, VARIANTS
from runtime.config import ConfigError, Settings
from runtime.logs import setup_logging

_SETTING_NAMES = {f.metadata["env"] for f in Settings.fields()}


def main(argv: Sequence[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    args = _parser().parse_args(argv)
    args.argv = argv  # recorded beside the results
    if args.command == "trace" and args.duration is None and args.requests is None:
        args.duration = 60.0
    setup_logging("info")
    try:
        missing = [name for name in ("httpx", "matplotlib") if importlib.util.find_spec(name) is None]
        if missing:  # found now, not after an hour of runs when the figure is drawn
            raise BenchError(f"needs {' and '.join(missing)}: pip install 'thawllm[bench]'")
        settings = server_settings(args)
        if args.command == "coldstart":
            from runtime.bench.coldstart_command import run_coldstart_command

            return _run_stoppable(run_coldstart_command(args, settings), args.out)
        if args.command == "switch":
            from runtime.bench.switch_command import run_switch_command

            return _run_stoppable(run_switch_command(args, settings), args.out)
        from runtime.bench.trace_command import run_trace_command

        return _run_stoppable(run_trace_command(args, settings), args.out)
    except (BenchError, ConfigError) as exc:
        print(f"faas-bench: {exc}", file=sys.stderr)
        return 2


def _run_stoppable(command: Coroutine[Any, Any, int], out: Path) -> int:
    """Run a command; SIGTERM or SIGINT (a time limit, Ctrl-C) cancels it, so that it unwinds through every
    server's stop (each runs in its own process group, which the signal did not reach) and leaves none running.
    Stopped so, it says what was kept and returns 128 + the signal's number, as a shell reports it."""
    received: list[int] = []

    async def run() -> int:
        loop, task = asyncio.get_running_loop(), asyncio.current_task()
        for signum in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(signum, lambda s=signum: (received.append(s), task.cancel()))
        return await command

    try:
        return asyncio.run(run())
    except asyncio.CancelledError:
        if not received:
            raise
    print(f"faas-bench: stopped by {signal.Signals(received[0]).name}; what finished is under {out}", file=sys.stderr)
    return 128 + received[0]


def server_settings(args: argparse.Namespace) -> dict[str, str]:
    """The settings every started server gets, as environment variables, checked by runtime.config."""
    settings: dict[str, str] = {}
    for item in args.set:
        name, sep, value = item.partition("=")
        if not sep or name not in _SETTING_NAMES:
            raise ConfigError(f"--set {item!r}: expected NAME=VALUE with NAME one of the runtime's settings "
                              f"(runtime/config.py), e.g. MAX_MODEL_LEN=2048")
        settings[name] = value
    for name, value in (("MODEL", getattr(args, "model", None)), ("SNAPSHOT_DIR", args.snapshot_dir),
                        ("DEVICE", args.device), ("DTYPE", args.dtype)):
        if value:
            settings[name] = str(value)
    Settings.from_env(settings)  # a bad value fails here, with the runtime's own one-line reason
    if getattr(args, "model", None) and not args.model.startswith("s3://") and not Path(
            args.model).expanduser().exists():
        raise ConfigError(f"--model {args.model!r}: no such file or directory")
    return settings


def _modes(allowed: tuple[str, ...], what: str = "modes"):
    def parse(text: str) -> tuple[str, ...]:
        modes = tuple(dict.fromkeys(m.strip() for m in text.split(",") if m.strip()))
        unknown = [m for m in modes if m not in allowed]
        if unknown or not modes:
            raise argparse.ArgumentTypeError(f"{what} must be among {','.join(allowed)}")
        return modes

    return parse


def _rates(text: str) -> tuple[float, ...]:
    try:
        rates = tuple(float(r) for r in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError("rates are numbers, e.g. 2,10") from None
    if not rates or any(r <= 0 for r in rates):
        raise argparse.ArgumentTypeError("rates must be positive")
    return rates


def _comma_list(text: str) -> tuple[str, ...]:
    return tuple(item.strip() for item in text.split(",") if item.strip())


def _positive(kind):
    def parse(text: str):
        value = kind(text)
        if value <= 0:
            raise argparse.ArgumentTypeError("must be positive")
        return value

    return parse


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="faas-bench", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--model", default=os.environ.get("MODEL"),
                        help="MODEL for the servers (default: $MODEL; unset: the embedded model)")
    common.add_argument("--snapshot-dir", default=os.environ.get("SNAPSHOT_DIR"),
                        help="SNAPSHOT_DIR for the servers, where faas-build wrote the snapshots")
    common.add_argument("--device", choices=("auto", "cpu", "cuda"), default=None, help="DEVICE for the servers")
    common.add_argument("--dtype", default=None, help="DTYPE for the servers")
    common.add_argument("--set", action="append", default=[], metavar="NAME=VALUE",
                        help="any other runtime setting for the servers (repeatable), e.g. MAX_MODEL_LEN=2048")
    common.add_argument("--out", type=Path, required=True, help="folder for the JSON, the PNG, the table, logs")
    common.add_argument("--timeout", type=_positive(float), default=900.0,
                        help="seconds a start or a request may take before the run is failed (900)")

    cold = sub.add_parser("coldstart", parents=[common], help="spawn -> first token per restore path",
                          description="Start a fresh server per mode and repetition; time spawn -> first token.")
    cold.add_argument("--modes", type=_modes(ALL_MODES + tuple(VARIANTS)), default=ALL_MODES,
                      help=f"comma-separated, among {','.join(ALL_MODES + tuple(VARIANTS))} (default: "
                           f"{','.join(ALL_MODES)}; gpu-after, process-after: gpu, process with "
                           "WEIGHTS_DURING_RESTORE=0; "
                           "process-during: process with WEIGHTS_DURING_RESTORE=1; process-unprimed: process with "
                           "PRIME_DRIVER=0; gpu-late, process-late: gpu, process with EARLY_RESTORE=0; "
                           "process-lazy: process with LAZY_PAGES=1; cold-unprefetched, process-unprefetched: cold, "
                           "process with PREFETCH_WEIGHTS=0; process-site, cold-site: process, cold started after "
                           "site, as the faas-bootstrap script starts; process-probing, gpu-probing: process, gpu "
                           "with CRIU_FEATURE_CACHE=0; process-whole-table: process with EMBEDDING_LAST=0)")
    cold.add_argument("--repeat", type=_positive(int), default=3, help="runs per mode (3)")
    cold.add_argument("--page-cache", choices=("warm", "dropped"), default="warm",
                      help="warm: files read once before the runs; dropped: drop_caches before each (root)")
    cold.add_argument("--prompt-tokens", type=_positive(int), default=161, help="prompt length (161, ShareGPT's mean)")
    cold.add_argument("--max-tokens", type=_positive(int), default=4, help="tokens generated per request (4)")
    cold.add_argument("--baseline-model", type=Path,
                      help="the Hugging Face directory the transformers baseline loads (default: --model; "
                           "give the source when --model is a faas-build layout)")

    trace = sub.add_parser("trace", parents=[common], help="Poisson arrivals against a scaled pool of instances",
                           description="Replay Poisson arrivals with ShareGPT-like lengths against instances "
                                       "that a scaler starts (real cold starts) and retires.")
    trace.add_argument("--modes", "--mode", type=_modes(SERVER_MODES), default=("cold",),
                       help=f"comma-separated, among {','.join(SERVER_MODES)} (default: cold)")
    trace.add_argument("--rates", type=_rates, default=(2.0, 10.0), help="requests per second (2,10)")
    length = trace.add_mutually_exclusive_group()
    length.add_argument("--duration", type=_positive(float), default=None,
                        help="seconds of arrivals per rate (60 unless --requests is given)")
    length.add_argument("--requests", type=_positive(int), default=None,
                        help="arrivals per rate instead: the first N of the seeded Poisson stream, so every rate "
                             "gets the same number of requests (its duration about N / rate)")
    trace.add_argument("--seed", type=int, default=0, help="seed of arrivals and lengths (0)")
    trace.add_argument("--prompt-mean", type=_positive(float), default=161.0, help="mean prompt tokens (161)")
    trace.add_argument("--output-mean", type=_positive(float), default=338.0, help="mean output tokens (338)")
    trace.add_argument("--length-scale", type=_positive(float), default=1.0,
                       help="multiplies both means, e.g. 0.05 for a CPU smoke run (1.0)")
    trace.add_argument("--max-len", type=_positive(int), default=None,
                       help="prompt + output are clipped to this (default: MAX_MODEL_LEN, else the model's, <= 4096)")
    trace.add_argument("--max-instances", type=_positive(int), default=4, help="instances at most (4)")
    trace.add_argument("--slots", type=_positive(int), default=16,
                       help="requests in flight per instance before more queue at the router (16)")
    trace.add_argument("--queue-threshold", type=int, default=4,
                       help="queued requests per starting instance that trigger one more start (4)")
    trace.add_argument("--idle-timeout", type=_positive(float), default=30.0,
                       help="an instance idle this long is retired (30 s)")
    trace.add_argument("--gpus", type=_comma_list, default=(),
                       help="spread instances over these GPUs, round robin, e.g. 0,1 (default: all see all)")
    trace.add_argument("--instance-snapshot-dirs", type=_comma_list, default=(), metavar="DIR,DIR,...",
                       help="one snapshot directory per instance running at once, each baked separately (instead of "
                            "--snapshot-dir): two restores of one CRIU snapshot on one host clash over its baked "
                            "pids and handoff socket, as two containers would not")
    trace.add_argument("--pid-namespaces", action="store_true",
                       help="start each instance in a pid namespace of its own, as a container is (needs root), so "
                            "a restore's baked pids are free whatever else runs on the host")
    _switch_parser(sub, common)
    return parser


def _shapes(text: str) -> list[tuple[str, int]]:
    from runtime.bench.switch_models import parse_shapes

    try:
        return parse_shapes(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _switch_parser(sub, common: argparse.ArgumentParser) -> None:
    switch = sub.add_parser(
        "switch", parents=[common], help="several models in one instance: switch latency and a multi-model trace",
        description="Random-weight models of real shapes in one instance: the switch latency to a model fully "
                    "retained, partly retained and evicted, beside a fresh instance of it and transformers; its first "
                    "activation with kernels loaded beside the weights, after them and restored; then "
                    "a multi-model trace (Zipf popularity) against LRU whole-model eviction and one instance per "
                    "model scaled to zero. --model is not used: the bench makes its models.")
    switch.add_argument("--shapes", type=_shapes, default=_shapes("qwen2-1.5b:4,llama-3-8b:2"),
                        help="shape:count,... among tiny, smollm2-135m, qwen2-1.5b, llama-3-8b "
                             "(default qwen2-1.5b:4,llama-3-8b:2; tiny:3 for a CPU smoke run)")
    switch.add_argument("--models-dir", type=Path,
                        help="where the models are made once and reused (default OUT/models)")
    switch.add_argument("--chunk-mb", type=_positive(float), default=16.0,
                        help="the layouts' chunk size: the pool evicts and reloads in groups of chunks (16)")
    switch.add_argument("--pool-gb", type=_positive(float),
                        help="the instance's pool (default: twice the largest model or half of all, the larger)")
    switch.add_argument("--prompt-tokens", type=_positive(int), default=161, help="switch probes' prompt (161)")
    switch.add_argument("--fresh-modes", type=_modes(SERVER_MODES), default=("cold",),
                        help="restore paths tried for the fresh instance of B, the fastest reported (cold; "
                             "for the others faas-build bakes B's snapshots first, e.g. process,cold)")
    switch.add_argument("--first-kernels", type=_modes(FIRST_KERNELS, "kernels"), default=FIRST_KERNELS,
                        help="first activations to probe, among beside (kernels loaded beside the weight stream), "
                             "after (POOL_KERNELS=after) and restored (graphs from pooled profiles faas-build "
                             "bakes first; a GPU only) (default: all three)")
    switch.add_argument("--rates", type=_rates, default=(1.0,), help="trace request rates (1)")
    switch.add_argument("--duration", type=_positive(float), default=120.0, help="seconds of arrivals per rate (120)")
    switch.add_argument("--zipf", type=float, default=1.0, help="Zipf exponent of model popularity (1.0)")
    switch.add_argument("--seed", type=int, default=0, help="seed of arrivals, lengths and models (0)")
    switch.add_argument("--prompt-mean", type=_positive(float), default=161.0, help="mean prompt tokens (161)")
    switch.add_argument("--output-mean", type=_positive(float), default=338.0, help="mean output tokens (338)")
    switch.add_argument("--length-scale", type=_positive(float), default=1.0,
                        help="multiplies both means, e.g. 0.02 for a CPU smoke run (1.0)")
    switch.add_argument("--max-len", type=_positive(int), default=2048, help="prompt + output clipped to this (2048)")
    switch.add_argument("--idle-timeout", type=_positive(float), default=30.0,
                        help="per-model instances idle this long are retired (30 s)")
    switch.add_argument("--gpus", type=_positive(int), default=1,
                        help="devices for the placement policies (affinity, round-robin, fixed): the first N "
                             "GPUs, or on cpu N host pools (POOL_CPU_DEVICES) (1)")


if __name__ == "__main__":
    sys.exit(main())
