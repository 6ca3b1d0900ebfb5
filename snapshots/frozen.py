"""The process a snapshot is made of (`python -m snapshots.frozen`, started by the bake in a new pid
namespace): it builds the engine (`process`: CPU phase only; `gpu`: started, ready to serve; with several
models, a process snapshot only: every model's engine, CPU phase only, on each of its devices), parks its
stdin/stdout/stderr on /dev/null, tells the bake it is ready and blocks waiting for a handoff. The bake
checkpoints it there.

After a restore, it takes over the bootstrap's stdout/stderr and environment (snapshots/handoff.py) and runs
the bootstrap again, in this process: settings, logging and the listening socket are all of the instance
it was restored into; the restore paths find the engine (or the models' engines) in `snapshots.thawed.current`.
"""

from __future__ import annotations

import argparse
import os
import runpy
import signal
import socket
import sys
import time
from pathlib import Path

from runtime.config import Settings
from runtime.logs import get_logger, setup_logging
from snapshots import handoff, thawed

log = get_logger("snapshots.frozen")


def build(kind: str, model_dir: Path | None, settings: Settings):
    """Everything a snapshot should already have done: the imports the server and the restore paths need,
    the engine (MODEL_DIR None: the several models' engines, a BuiltModels)."""
    import handlers.health  # noqa: F401  the server's imports, so the restored process has them
    import handlers.openai  # noqa: F401
    from runtime.launch import build_engine, engine_config
    from runtime.server.app import load_async_backend
    from runtime.server.serve import load_protocols

    load_async_backend()
    load_protocols()
    load_restore_path(kind)
    if kind == "process" and settings.device.startswith("cuda"):
        from runtime.engine.kernels import ask_ptxas_for
        from snapshots.fingerprint import gpu_capabilities

        ask_ptxas_for(gpu_capabilities())  # the restored runtime's first launch then runs no program
    if model_dir is None:
        built = build_several(settings)
        trim_host_heap()
        return built
    # the served name is the bootstrap's to give (after restore, from SERVED_NAME/MODEL as they are then)
    engine = build_engine(model_dir, engine_config(settings, settings.device))  # DEVICE resolved by the bake
    if kind == "gpu":
        stream = settings.gpu_snapshot_weights == "stream"
        engine.start(releasable_memory=stream)
        if settings.gpu_snapshot_warm_up:
            from runtime.engine.warm_up import warm_up

            done = warm_up(engine)
            log.info("gpu snapshot: warmed up with %d requests (prompts of %s tokens) in %.2f s", done.requests,
                     ", ".join(map(str, done.prompt_lengths)), done.seconds)
        if stream:  # the image keeps the addresses, not the bytes: the weights stream back after restore
            log.info("gpu snapshot: %.2f GiB of weights and KV cache released before the checkpoint",
                     engine.release_device_memory() / 2**30)
        drop_cached_memory()
        release_local_memory()
    trim_host_heap()
    return engine


def load_restore_path(kind: str) -> None:
    """The modules the restored bootstrap's restore path runs (snapshots/restore.py; for a process snapshot,
    the materialised KV size and graphs' too): imported after the restore, they took 45 ms of the bootstrap's
    second run on the CPU machine. None of them loads libcuda on import."""
    import snapshots.restore  # noqa: F401

    if kind == "process":
        import snapshots.cudagraph.restore  # noqa: F401
        import snapshots.materialized  # noqa: F401


def build_several(settings: Settings):
    """Several models: each model's engine on every device its placement gives it, as runtime/multi_model.py
    would build them at boot, named as they are served (the names are in the fingerprint)."""
    import runtime.pool.pool  # noqa: F401  the pools are made after the restore, their imports before it
    from runtime.launch import build_engine, engine_config
    from runtime.multi_model import build_models, planned_placements

    def build_one(per_model: Settings, device: str):
        return build_engine(Path(per_model.model), engine_config(per_model, device), None,
                            per_model.served_model_name, per_model)

    return build_models(settings, planned_placements(settings), build_one)


def trim_host_heap() -> None:
    """Give the C heap's free pages back to the kernel: free but still resident, they would be dumped
    into the image and read back at every restore."""
    import ctypes
    import gc

    gc.collect()
    try:
        ctypes.CDLL(None).malloc_trim(0)
    except AttributeError:  # not glibc
        pass


def drop_cached_memory() -> None:
    """What the allocators keep for reuse would be dumped with the process: torch's cached GPU blocks and
    its cached pinned host buffers (the weight loader's ring, 512 MiB with 16 readers)."""
    import torch

    torch.cuda.empty_cache()
    empty_host_cache = getattr(getattr(torch, "accelerator", None), "empty_host_cache", None) \
        or getattr(torch._C, "_host_emptyCache", None)
    if empty_host_cache is not None:
        empty_host_cache()


#: the per-thread stack size the context had before the checkpoint; given back right after the restore
_stack_bytes: int | None = None


def release_local_memory() -> None:
    """The CUDA checkpoint copies all the device memory the context holds into the image, and the context
    reserves stack for every thread the GPU can hold (1 KiB each by default: 264 MiB on an H100). Its
    contents never matter between launches: a stack limit of 0 frees it before the checkpoint, and
    `restore_local_memory` reserves it afresh after the restore (the CUDA graphs' kernels need it there)."""
    global _stack_bytes
    from runtime.cuda_driver import stack_limit

    _stack_bytes = stack_limit()
    stack_limit(0)


def restore_local_memory() -> bool:
    """Give the context back the stack `release_local_memory` freed; False where nothing was released."""
    if _stack_bytes is None:
        return False
    from runtime.cuda_driver import stack_limit

    stack_limit(_stack_bytes)
    return True


def start_device_phase(engine, channel: socket.socket | None) -> thawed.WeightHandover | None:
    """A restored process snapshot: its CUDA context is made from now on, on a thread, while the bootstrap
    runs again (the context alone took 0.27-0.35 s on the H100); the weights, if CHANNEL came, are being
    streamed by the helper the bootstrap started before the restore. Returns what `Engine.start` adopts."""
    if engine.config.on_cuda:
        import threading

        threading.Thread(target=engine.init_device, args=(True,), name="cuda-init", daemon=True).start()
    if channel is None:
        return None
    if not engine.config.on_cuda:
        channel.close()
        return None
    from snapshots.weights_during_restore import ExportedWeights

    return ExportedWeights(channel)


def reload_released_weights(engine, channel: socket.socket | None) -> thawed.WeightReload | None:
    """Right after a restore, map memory back under what the snapshot left out, and get the weights into
    it: from the CUDA restore helper, which has been streaming them during the restore (CHANNEL), or by
    streaming them now."""
    if engine.runner is None or not engine.runner.allocator.released:
        if channel is not None:
            channel.close()  # the helper gets EOF and frees what it streamed
        return None
    if channel is not None:
        from snapshots.weights_during_restore import HandedOverWeights

        return HandedOverWeights(engine, channel)
    return StreamedWeights(engine)


class StreamedWeights:
    """The weights streamed by the restored process itself, after the restore."""

    def __init__(self, engine) -> None:
        self.started = time.time()
        engine.runner.allocator.remap()
        self._remap_s = time.time() - self.started
        self._bytes = engine.plan.total_bytes
        self._load = engine.reload_weights()

    def wait(self) -> tuple[float, dict]:
        self._load.wait()
        detail = {"bytes": self._bytes, "after_restore": True, "remap_s": round(self._remap_s, 4)}
        detail.update(self._load.detail())
        return self.started, detail


def park_stdio() -> None:
    """Nothing outside the snapshot may be referenced from it: stdio goes to /dev/null, which exists
    wherever it is restored."""
    sys.stdout.flush()
    sys.stderr.flush()
    null = os.open(os.devnull, os.O_RDWR)
    for fd in (0, 1, 2):
        os.dup2(null, fd)
    os.close(null)


def main() -> int:
    parser = argparse.ArgumentParser(prog="snapshots.frozen")
    parser.add_argument("--kind", choices=("process", "gpu"), required=True)
    parser.add_argument("--snapshot-id", required=True)
    parser.add_argument("--model-dir", type=Path, help="the model (unset: the several models MODEL names)")
    parser.add_argument("--ready-fd", type=int, required=True)
    args = parser.parse_args()
    os.setsid()  # CRIU dumps whole sessions: this process leads its own
    settings = Settings.from_env()
    setup_logging(settings.log_level)
    built = build(args.kind, args.model_dir, settings)
    engine, models = (built, None) if args.model_dir is not None else (None, built)
    listener = handoff.listen(args.snapshot_id)
    log.info("%s snapshot: engine built, waiting to be checkpointed", args.kind)
    park_stdio()
    os.write(args.ready_fd, b"ready\n")
    os.close(args.ready_fd)

    # checkpointed while it waits in here; everything after it runs restored
    received, conn, channel = handoff.receive(listener, args.snapshot_id)
    stack_started = time.time()
    if restore_local_memory():
        received.restore_detail["stack_s"] = round(time.time() - stack_started, 4)
    taken_over_at = time.time()
    os.environ["THAWLLM_SPAWN_TIME"] = repr(received.spawn_time)
    if received.verify and engine is not None and engine.runner is not None:
        engine.runner.allocator.remap()  # the bake checks that released ranges map again (no-op if none)
    weights = handover = None
    if args.kind == "process" and not received.verify:
        # several models: the first model's engine is the one the start makes resident; no weights channel
        handover = start_device_phase(engine or models.first(), channel)
    elif not received.verify:
        weights = reload_released_weights(engine, channel)
    thawed.current = thawed.Thawed(args.kind, engine, received, taken_over_at, weights, handover, models)
    # As the init of its pid namespace this process ignores signals it has no handler for: until the server
    # installs its own (drain on SIGTERM), a SIGTERM forwarded by the bootstrap ends it.
    signal.signal(signal.SIGTERM, lambda signum, frame: os._exit(128 + signum))
    handoff.acknowledge(conn)
    if received.verify:
        return 0
    sys.argv = ["faas-bootstrap", *received.argv]
    runpy.run_module("runtime.bootstrap", run_name="__main__", alter_sys=True)  # exits with its status
    return 0


if __name__ == "__main__":
    sys.exit(main())
