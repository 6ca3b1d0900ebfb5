"""The weights, streamed while CRIU restores the process: for a weight-less gpu snapshot and for a process
snapshot of a CUDA engine.

Without this, a restore is sequential: CRIU restores the process, its CUDA state comes back (gpu) or its CUDA
context is made (process, ~0.3 s on the H100), and only then does the restored engine stream its weights
(~0.4-0.9 s for Llama-3-8B). A helper process started before CRIU takes the weights instead: for a gpu
snapshot the CUDA restore helper (snapshots/cuda_checkpoint.py), which is running anyway; for a process
snapshot one that only streams (`python -m snapshots.weights_during_restore`).

helper (`stream_for_handover`): creates device memory that can be exported as a POSIX file descriptor, the
size of the engine's weight range; streams the layout into it with the engine's own loader (a DriverSink:
the helper never imports torch, which alone takes longer than the restore); sends the descriptor, with the
stream's figures, over a socket pair whose other end the handoff gave the restored process; waits until the
restored process has mapped it (its own CUDA context holds the memory until then).

restored process (`ExportedWeights`): maps that memory at its weight addresses (runtime/engine/vmm.py:
`adopt`): a gpu snapshot's reserved range, after the restore (`HandedOverWeights`); a process snapshot's new
one, in `Engine.start`, in place of the loader. Anything the helper could not do (no local layout, no
exportable memory, a chunk that fails its check) arrives as a reason instead, and the restored process
streams the weights itself, logging why.
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
class StreamReport:
    """What the helper sends, with the descriptor when `ok`."""

    ok: bool
    reason: str = ""  # why not, when not ok
    size: int = 0  # bytes of the exported allocation
    context_s: float = 0.0  # the helper's CUDA context and allocation, before the stream
    started: float = 0.0  # time.time() at the stream's start and end
    finished: float = 0.0
    bytes: int = 0
    tiers: dict = field(default_factory=dict)


# -- the helper's side -----------------------------------------------------------------------------------


def stream_for_handover(layout_dir: Path, channel: socket.socket) -> None:
    """Stream the layout at LAYOUT_DIR into exportable device memory and hand it over on CHANNEL. Never
    raises: a failure is reported to the restored process, which then streams the weights itself."""
    try:
        memory, report = _stream(layout_dir)
        fd = memory.export()
    except Exception as exc:  # noqa: BLE001 - whatever it was, the restored process streams instead
        try:
            _send(channel, StreamReport(False, reason=f"{type(exc).__name__}: {exc}"))
        except OSError:
            pass
        return
    try:
        _send(channel, report, fd)
        os.close(fd)
        channel.settimeout(ACK_TIMEOUT_S)
        channel.recv(len(ACK))  # mapped (or the restored process is gone): our context may go now
    except OSError:
        pass
    finally:
        memory.free()


def _stream(layout_dir: Path) -> tuple["ExportableMemory", StreamReport]:
    from runtime.weights.loader import LoaderOptions, WeightStream, readers_for
    from runtime.weights.manifest import Manifest, is_layout
    from runtime.weights.readers import READERS
    from runtime.weights.sinks import DriverSink
    from runtime.weights.sources import LocalFile

    if not is_layout(layout_dir):
        raise ValueError(f"{layout_dir} is not a faas-build layout")
    manifest = Manifest.read(layout_dir)
    missing = [f.name for f in manifest.files if not (layout_dir / f.name).is_file()]
    if missing:
        raise ValueError(f"{len(missing)} weight files are not on local disk (e.g. {missing[0]})")
    READERS.start(readers_for(manifest, LoaderOptions()))  # while none runs: before the CUDA context
    started = time.time()
    memory = ExportableMemory(manifest.plan.total_bytes)
    context_s = time.time() - started
    try:
        sources = [LocalFile(layout_dir / f.name) for f in manifest.files]
        stream = WeightStream(manifest, sources, DriverSink(memory.ptr, memory.size, memory.context),
                              LoaderOptions(), str(layout_dir)).wait()
    except BaseException:
        memory.free()  # not held while the helper waits to finish the CUDA restore
        raise
    return memory, StreamReport(True, size=memory.size, context_s=round(context_s, 4), started=stream.started,
                                finished=time.time(), bytes=manifest.total_bytes, tiers=stream.tier_stats())


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


def _send(channel: socket.socket, report: StreamReport, fd: int | None = None) -> None:
    ancillary = [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", [fd]))] if fd is not None else []
    channel.sendmsg([orjson.dumps(asdict(report))], ancillary)


def receive_report(channel: socket.socket) -> tuple[StreamReport, int | None]:
    """The helper's report and, when it is ok, the descriptor of the memory (the caller closes it). A helper
    that died says nothing: that is a report too."""
    fds = array.array("i")
    try:
        message, ancillary, _, _ = channel.recvmsg(_MAX_MESSAGE, socket.CMSG_SPACE(fds.itemsize))
    except OSError as exc:
        return StreamReport(False, reason=f"the helper's channel failed: {exc}"), None
    for level, kind, data in ancillary:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            fds.frombytes(data[: len(data) - len(data) % fds.itemsize])
    if not message:
        return StreamReport(False, reason="the CUDA restore helper exited without streaming the weights"), None
    report = StreamReport(**orjson.loads(message))
    fd = fds[0] if len(fds) else None
    if report.ok and fd is None:
        return StreamReport(False, reason="the helper's report came without its memory"), None
    return report, fd


# -- the restored process's side ---------------------------------------------------------------------------


class ExportedWeights:
    """The restored process's end of the channel: `take()` waits for the helper's report and returns the
    memory's (descriptor, bytes), or None (the reason logged) when the weights must be streamed here;
    `mapped(ok)` lets the helper go. The engine's WeightHandover (runtime/engine/llm_engine.py)."""

    def __init__(self, channel: socket.socket) -> None:
        self._channel = channel
        self._report: StreamReport | None = None
        self._fd: int | None = None

    def take(self) -> tuple[int, int] | None:
        report, self._fd = receive_report(self._channel)
        self._report = report
        if not report.ok:
            log.warning("weights not streamed during the restore (%s); streaming them now", report.reason)
            self._channel.close()
            return None
        return self._fd, report.size

    def close(self) -> None:
        """Done with the channel, whatever happened (the helper, on EOF, frees what it streamed)."""
        self._channel.close()

    @property
    def reason(self) -> str:
        return self._report.reason if self._report is not None else ""

    def mapped(self, ok: bool) -> tuple[float, float, dict]:
        report = self._report
        try:
            os.close(self._fd)
            if ok:
                self._channel.sendall(ACK)
        except OSError:
            pass  # the helper is gone: the memory is ours through the imported handle
        finally:
            self._channel.close()
        return report.started, report.finished, {"bytes": report.bytes, "during_restore": True,
                                                 "tiers": report.tiers, "helper_context_s": report.context_s}


class HandedOverWeights:
    """A weight-less gpu snapshot's weights, started right after the take-over: a thread waits for the
    helper's memory and maps it under the weight range (or, if the helper could not deliver, streams the
    weights as the restored process always did). `wait()` returns (when the weights started arriving,
    timeline detail)."""

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
            exported = self._exported.take()
            reason = self._exported.reason
            if exported is not None:
                started = time.time()
                try:
                    self._engine.runner.allocator.releasable("weights").adopt(*exported)
                except Exception as exc:  # noqa: BLE001 - stream instead, and say why
                    self._exported.mapped(False)
                    reason = f"mapping the helper's memory failed: {exc}"
                    log.warning("weights not streamed during the restore (%s); streaming them now", reason)
                else:
                    arrived, _, detail = self._exported.mapped(True)
                    self._result = arrived, detail | {"import_s": round(time.time() - started, 4)}
                    return
            started = time.time()
            self._fallback = self._engine.reload_weights()
            self._result = started, {"bytes": self._engine.plan.total_bytes, "after_restore": True,
                                     "helper": reason}
        except BaseException as exc:  # noqa: BLE001 - raised by wait()
            self._error = exc

    def wait(self) -> tuple[float, dict]:
        self._thread.join()
        if self._error is not None:
            raise self._error
        if self._fallback is not None:
            self._fallback.wait()
            if hasattr(self._fallback, "tier_stats"):
                self._result[1]["tiers"] = self._fallback.tier_stats()
        return self._result


if __name__ == "__main__":
    # the process snapshot's helper: stream LAYOUT into exportable memory, hand it over on the channel
    import argparse

    parser = argparse.ArgumentParser(prog="snapshots.weights_during_restore")
    parser.add_argument("--weights", type=Path, required=True, help="the layout to stream")
    parser.add_argument("--channel-fd", type=int, required=True, help="the socket to hand the weights over on")
    args = parser.parse_args()
    stream_for_handover(args.weights, socket.socket(fileno=args.channel_fd))
