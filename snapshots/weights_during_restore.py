"""The weights, streamed while CRIU restores the process: for a weight-less gpu snapshot and for a process
snapshot of a CUDA engine.

Without this, a restore is sequential: CRIU restores the process, its CUDA state comes back (gpu) or its CUDA
context is made (process, ~0.3 s on the H100), and only then does the restored engine stream its weights
(~0.4-0.9 s for Llama-3-8B). A helper process started before CRIU takes the weights instead: for a gpu
snapshot the CUDA restore helper (snapshots/cuda_checkpoint.py), which is running anyway; for a process
snapshot one that only streams (`python -m snapshots.weights_during_restore`).

helper (`stream_for_handover`): creates device memory that can be exported as a POSIX file descriptor, the
size of the engine's weight range, and sends the descriptor at once (`HelperMemory`; with WEIGHTS_MEMORY_FIRST=0
after the stream) over a socket pair whose other end the handoff gave the restored process; streams the layout
into it with the engine's own loader (a DriverSink: the helper never imports torch, which alone takes longer than
the restore); sends the stream's `StreamReport`; waits until the restored process has mapped the memory (its own
CUDA context holds the memory until then).

restored process (`ExportedWeights`): maps that memory at its weight addresses (runtime/engine/vmm.py:
`adopt`) as soon as it arrives, before its contents: a gpu snapshot's reserved range, after the restore
(`HandedOverWeights`); a process snapshot's new one, in `Engine.start`, in place of the loader, which then
sets up its KV cache and decode graphs while the weights still arrive (from a cold disk that is most of
the restore) and serves nothing before the report says that every chunk arrived and passed its check. A
process snapshot's helper may leave the embedding table's whole chunks out (EMBEDDING_LAST); the report names
them, and the restored process reads them itself (runtime/engine/embedding_fill.py).
Anything the helper could not do (no local layout, no exportable memory, a chunk that fails its check)
arrives as a reason instead, and the restored process streams the weights itself, logging why: into new
memory at the same addresses, so that no copy the helper left in flight can land on them.
"""

from __future__ import annotations

import array
import os
import socket
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import orjson

from runtime.logs import get_logger

log = get_logger("snapshots.weights_during_restore")

ACK = b"ok"
#: how long the helper keeps the memory for a restored process that has not mapped it yet
ACK_TIMEOUT_S = 120.0
_MAX_MESSAGE = 1 << 16


@dataclass
class HelperMemory:
    """The helper's first message, with the memory's descriptor: sent before the stream starts."""

    size: int  # bytes of the exported allocation
    context_s: float  # the helper's CUDA context and allocation


@dataclass
class StreamReport:
    """The helper's last message: the weights all arrived and passed their checks (`ok`), or why not. A
    helper that could not make the memory sends only this."""

    ok: bool
    reason: str = ""  # why not, when not ok
    started: float = 0.0  # time.time() at the stream's start and end
    finished: float = 0.0
    bytes: int = 0
    tiers: dict = field(default_factory=dict)
    # layout chunks not streamed: the part of the embedding table the restored process reads itself
    # (EMBEDDING_LAST; runtime/weights/embedding_blocks.py)
    deferred: list = field(default_factory=list)


# -- the helper's side -----------------------------------------------------------------------------------


def stream_for_handover(layout_dir: Path, channel: socket.socket, memory_first: bool = True,
                        embedding_last: bool = False) -> None:
    """Make exportable memory for the layout at LAYOUT_DIR, hand it over on CHANNEL, stream the layout into
    it, then report; MEMORY_FIRST False hands the memory over only after the stream, right before the report
    (WEIGHTS_MEMORY_FIRST=0: the restored process then sets up around it once the weights are there);
    EMBEDDING_LAST: leave the embedding table's whole chunks to the restored process where the layout lets it.
    Never raises: a failure is reported to the restored process, which then streams the weights itself."""
    try:
        manifest = _local_manifest(layout_dir)
        started = time.time()
        memory = ExportableMemory(manifest.plan.total_bytes)
    except Exception as exc:  # noqa: BLE001 - whatever it was, the restored process streams instead
        _send_quietly(channel, StreamReport(False, reason=f"{type(exc).__name__}: {exc}"))
        return
    freed = reported = False
    try:
        context_s = round(time.time() - started, 4)
        deferred = frozenset()
        if embedding_last:
            from runtime.weights.embedding_blocks import deferred_chunks

            deferred = deferred_chunks(manifest)
        report = None if memory_first else _stream(layout_dir, manifest, memory, deferred)
        fd = memory.export()
        try:
            _send(channel, {"memory": asdict(HelperMemory(memory.size, context_s))}, fd)
        finally:
            os.close(fd)
        if report is None:
            report = _stream(layout_dir, manifest, memory, deferred)
        if not report.ok:  # its copies stopped and our handle gone before the report: the restored process
            memory.free()  # then frees the memory with its own and maps new memory in its place
            freed = True
        _send(channel, {"report": asdict(report)})
        reported = True
        channel.settimeout(ACK_TIMEOUT_S)
        channel.recv(len(ACK))  # mapped (or the restored process is gone): our context may go now
    except Exception as exc:  # noqa: BLE001 - the export failed, or the restored process is gone
        if not reported:
            _send_quietly(channel, StreamReport(False, reason=f"{type(exc).__name__}: {exc}"))
    finally:
        if not freed:
            memory.free()


def _local_manifest(layout_dir: Path):
    from runtime.weights.loader import LoaderOptions, readers_for
    from runtime.weights.manifest import Manifest, is_layout
    from runtime.weights.readers import READERS

    if not is_layout(layout_dir):
        raise ValueError(f"{layout_dir} is not a faas-build layout")
    manifest = Manifest.read(layout_dir)
    missing = [f.name for f in manifest.files if not (layout_dir / f.name).is_file()]
    if missing:
        raise ValueError(f"{len(missing)} weight files are not on local disk (e.g. {missing[0]})")
    READERS.start(readers_for(manifest, LoaderOptions()))  # while none runs: before the CUDA context
    return manifest


def _stream(layout_dir: Path, manifest, memory: "ExportableMemory", deferred: frozenset[int]) -> StreamReport:
    """Every chunk of the layout but the DEFERRED ones into MEMORY, checked on the host; a failure is a report."""
    from runtime.weights.loader import LoaderOptions, WeightStream, layout_chunks
    from runtime.weights.sinks import DriverSink
    from runtime.weights.sources import LocalFile

    only = frozenset(range(len(layout_chunks(manifest)))) - deferred if deferred else None
    try:
        sources = [LocalFile(layout_dir / f.name) for f in manifest.files]
        stream = WeightStream(manifest, sources, DriverSink(memory.ptr, memory.size, memory.context),
                              LoaderOptions(), str(layout_dir), only).wait()
    except Exception as exc:  # noqa: BLE001 - reported
        return StreamReport(False, reason=f"{type(exc).__name__}: {exc}")
    return StreamReport(True, started=stream.started, finished=time.time(), bytes=stream.bytes,
                        tiers=stream.tier_stats(), deferred=sorted(deferred))


class ExportableMemory:
    """Device memory in this (torch-free) process, mapped here for the loader to fill and exportable as a POSIX
    file descriptor. Sized exactly as the engine's releasable weight range (runtime/engine/vmm.py)."""

    def __init__(self, nbytes: int, device: int = 0) -> None:
        from cuda.bindings import driver as d

        from runtime.cuda_driver import allocation_prop, call, map_range, reserve

        self._d = d
        call(d.cuInit(0), "cuInit")
        dev = call(d.cuDeviceGet(device), "cuDeviceGet")
        self.context = call(d.cuDevicePrimaryCtxRetain(dev), "cuDevicePrimaryCtxRetain")
        self._device = dev
        call(d.cuCtxSetCurrent(self.context), "cuCtxSetCurrent")
        prop = allocation_prop(device, exportable=True)
        self.ptr, self.size = reserve(prop, nbytes)
        self.handle = call(d.cuMemCreate(self.size, prop, 0), "cuMemCreate")
        map_range(self.ptr, self.size, self.handle, device)

    def export(self) -> int:
        from runtime.cuda_driver import call

        d = self._d
        return int(call(d.cuMemExportToShareableHandle(
            self.handle, d.CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, 0),
            "cuMemExportToShareableHandle"))

    def free(self) -> None:
        d = self._d
        d.cuCtxSynchronize()  # no copy of a failed stream still writing into it
        d.cuMemUnmap(self.ptr, self.size)
        d.cuMemRelease(self.handle)  # the importer's handle keeps the memory alive
        d.cuMemAddressFree(self.ptr, self.size)
        d.cuDevicePrimaryCtxRelease(self._device)


def _send(channel: socket.socket, message: dict, fd: int | None = None) -> None:
    ancillary = [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", [fd]))] if fd is not None else []
    channel.sendmsg([orjson.dumps(message)], ancillary)


def _send_quietly(channel: socket.socket, report: StreamReport) -> None:
    try:
        _send(channel, {"report": asdict(report)})
    except OSError:
        pass  # the restored process is gone


def receive(channel: socket.socket) -> tuple[HelperMemory | StreamReport, int | None]:
    """The helper's next message and the descriptor that came with it (the caller closes it). A helper that
    died says nothing: that is a report too."""
    fds = array.array("i")
    try:
        message, ancillary, _, _ = channel.recvmsg(_MAX_MESSAGE, socket.CMSG_SPACE(fds.itemsize))
    except ConnectionResetError:  # it died with our ack unread
        message, ancillary = b"", []
    except OSError as exc:
        return StreamReport(False, reason=f"the helper's channel failed: {exc}"), None
    for level, kind, data in ancillary:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            fds.frombytes(data[: len(data) - len(data) % fds.itemsize])
    fd = fds[0] if len(fds) else None
    if not message:
        return StreamReport(False, reason="the weights' helper exited before it reported the stream"), fd
    body = orjson.loads(message)
    if "memory" in body:
        if fd is None:
            return StreamReport(False, reason="the helper's memory came without its descriptor"), None
        return HelperMemory(**body["memory"]), fd
    return StreamReport(**body["report"]), fd


# -- the restored process's side ---------------------------------------------------------------------------


class ExportedWeights:
    """The restored process's end of the channel, the engine's WeightHandover (runtime/engine/llm_engine.py):
    `take()` waits for the helper's memory, `mapped(ok)` says it is mapped, `arrived()` waits for the report
    that the weights are all in it and checked. `reason` says why, when the weights must be streamed here."""

    def __init__(self, channel: socket.socket) -> None:
        self._channel = channel
        self._memory: HelperMemory | None = None
        self._fd: int | None = None
        self.reason = ""
        self.deferred: frozenset[int] = frozenset()  # the chunks the helper left to this process, once arrived

    def take(self) -> tuple[int, int] | None:
        """The memory's (descriptor, bytes), its weights maybe still arriving; None (why logged)."""
        message, self._fd = receive(self._channel)
        if isinstance(message, HelperMemory):
            self._memory = message
            return self._fd, message.size
        self._not_streamed(message.reason)
        return None

    def mapped(self, ok: bool) -> None:
        """The memory is mapped (OK: the helper may let its handle go once it has streamed) or could not be
        (the helper is told, by the channel's end, to stop and free it)."""
        try:
            os.close(self._fd)
            if ok:
                self._channel.sendall(ACK)
        except OSError:
            pass  # the helper is gone: its report says so
        if not ok:
            self._channel.close()

    def arrived(self) -> tuple[float, float, dict] | None:
        """Wait for the helper's report: (time.time() the weights started and finished arriving, the
        timeline's detail) once all of them are in the memory and checked; None (why logged) if they are not,
        and the memory must not be used."""
        message, fd = receive(self._channel)
        self._channel.close()
        if fd is not None:
            os.close(fd)
        if isinstance(message, HelperMemory):
            message = StreamReport(False, reason="the helper sent its memory twice")
        if not message.ok:
            self._not_streamed(message.reason)
            return None
        self.deferred = frozenset(message.deferred)
        return message.started, message.finished, {"bytes": message.bytes, "during_restore": True,
                                                   "tiers": message.tiers, "deferred_chunks": len(self.deferred),
                                                   "helper_context_s": self._memory.context_s}

    def _not_streamed(self, reason: str) -> None:
        self.reason = reason
        self._channel.close()
        log.warning("weights not streamed during the restore (%s); streaming them now", reason)

    def close(self) -> None:
        """Done with the channel, whatever happened (the helper, on EOF, frees what it streamed)."""
        self._channel.close()


class HandedOverWeights:
    """A weight-less gpu snapshot's weights, started right after the take-over: a thread waits for the
    helper's memory, maps it under the weight range and waits for its report (or, if the helper could not
    deliver, streams the weights as the restored process always did). `wait()` returns (when the weights
    started arriving, timeline detail)."""

    def __init__(self, engine, channel: socket.socket) -> None:
        self._engine = engine
        self._exported = ExportedWeights(channel)
        self._fallback = None
        self._result: tuple[float, dict] | None = None
        self._error: BaseException | None = None
        allocator = engine.runner.allocator
        allocator.remap(skip=("weights",))  # the KV cache: new memory, as before
        self._thread = threading.Thread(target=self._receive, name="weights-handover", daemon=True)
        self._thread.start()

    def _receive(self) -> None:
        try:
            if self._adopted():
                return
            started = time.time()
            self._fallback = self._engine.reload_weights()
            self._result = started, {"bytes": self._engine.plan.total_bytes, "after_restore": True,
                                     "helper": self._exported.reason}
        except BaseException as exc:  # noqa: BLE001 - raised by wait()
            self._error = exc

    def _adopted(self) -> bool:
        """The helper's memory mapped under the weight range, its weights all arrived: else False, the range
        unmapped again, to be streamed into."""
        exported = self._exported.take()
        if exported is None:
            return False
        weights = self._engine.runner.allocator.releasable("weights")
        started = time.time()
        try:
            weights.adopt(*exported)
        except Exception as exc:  # noqa: BLE001 - stream instead, and say why
            self._exported.mapped(False)
            self._exported.reason = f"mapping the helper's memory failed: {exc}"
            log.warning("weights not streamed during the restore (%s); streaming them now", self._exported.reason)
            return False
        self._exported.mapped(True)
        import_s = round(time.time() - started, 4)
        arrived = self._exported.arrived()
        if arrived is None:
            weights.replace_adopted()
            return False
        self._result = arrived[0], arrived[2] | {"import_s": import_s}
        return True

    def wait(self) -> tuple[float, dict]:
        self._thread.join()
        if self._error is not None:
            raise self._error
        if self._fallback is not None:
            self._fallback.wait()
            self._result[1].update(self._fallback.detail())
        return self._result


if __name__ == "__main__":
    # the process snapshot's helper: stream LAYOUT into exportable memory, hand it over on the channel
    import argparse

    parser = argparse.ArgumentParser(prog="snapshots.weights_during_restore")
    parser.add_argument("--weights", type=Path, required=True, help="the layout to stream")
    parser.add_argument("--channel-fd", type=int, required=True, help="the socket to hand the weights over on")
    parser.add_argument("--memory-after-stream", action="store_true", help="hand the memory over with the report")
    parser.add_argument("--embedding-last", action="store_true",
                        help="leave the embedding table's whole chunks to the restored process")
    args = parser.parse_args()
    stream_for_handover(args.weights, socket.socket(fileno=args.channel_fd), not args.memory_after_stream,
                        args.embedding_last)
