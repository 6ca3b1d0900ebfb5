"""The channel between the CUDA restore helper and the restored process (snapshots/weights_during_restore.py),
over real unix sockets: the memory's descriptor arrives intact before the stream's report, the restored
process's end waits for that report before it calls the weights arrived, and whatever keeps the helper from
streaming reaches the restored process as a reason (it then streams the weights itself). The whole path,
with a real gpu snapshot, is in tests/snapshots/test_gpu_snapshot.py."""

from __future__ import annotations

import os
import socket
import threading

import pytest

from runtime.weights.layout import write_layout
from runtime.weights.manifest import Manifest
from snapshots.weights_during_restore import (ACK, ExportedWeights, StreamReport, _send, receive,
                                              stream_for_handover)


def helper_says(layout_dir) -> StreamReport:
    """Run the helper's side on LAYOUT_DIR in a thread, as the helper process does; the restored side's view."""
    helper_end, restored_end = socket.socketpair()
    helper = threading.Thread(target=stream_for_handover, args=(layout_dir, helper_end))
    helper.start()
    report, fd = receive(restored_end)
    helper_end.close()
    helper.join(timeout=60)
    assert not helper.is_alive()
    assert fd is None
    return report


def test_a_directory_that_is_not_a_layout_is_reported(tmp_path):
    report = helper_says(tmp_path)
    assert not report.ok and "is not a faas-build layout" in report.reason


def test_a_layout_whose_files_are_not_on_disk_is_reported(tiny_model, tmp_path):
    layout = tmp_path / "layout"
    write_layout(tiny_model("tiny-llama"), str(layout), dtype="float32", file_bytes=1 << 20, progress=False)
    first = Manifest.read(layout).files[0].name
    (layout / first).unlink()  # as in a layout cached from S3 whose files have not been fetched
    report = helper_says(layout)
    assert not report.ok and "not on local disk" in report.reason and first in report.reason


def test_no_gpu_is_reported_not_raised(tiny_model, tmp_path):
    try:
        import torch

        if torch.cuda.is_available():
            pytest.skip("this machine has a GPU: the helper would stream")
    except ImportError:
        pass
    layout = tmp_path / "layout"
    write_layout(tiny_model("tiny-llama"), str(layout), dtype="float32", file_bytes=1 << 20, progress=False)
    report = helper_says(layout)
    assert not report.ok and report.reason  # e.g. no cuda-bindings, or cuInit: CUDA_ERROR_NO_DEVICE


def helper_memory(helper_end: socket.socket) -> int:
    """Send a memory message as the helper does, with a memfd standing in for the exported device memory (any
    descriptor travels alike); returns the memfd."""
    memory = os.memfd_create("weights")
    os.write(memory, b"the weights")
    _send(helper_end, {"memory": {"size": 4096, "context_s": 0.25}}, memory)
    return memory


def memory_taken_and_mapped() -> tuple[socket.socket, ExportedWeights, int]:
    """The helper's end, the restored process's end once it has taken and mapped the memory, and the memfd."""
    helper_end, restored_end = socket.socketpair()
    memory = helper_memory(helper_end)
    exported = ExportedWeights(restored_end)
    exported.take()
    exported.mapped(True)
    return helper_end, exported, memory


def test_the_memory_arrives_before_its_report_and_the_report_after_the_ack():
    helper_end, restored_end = socket.socketpair()
    memory = helper_memory(helper_end)
    exported = ExportedWeights(restored_end)
    fd, size = exported.take()
    assert size == 4096 and fd != memory and os.pread(fd, 64, 0) == b"the weights"
    exported.mapped(True)
    assert helper_end.recv(len(ACK)) == ACK  # the helper may let its handle go once it has reported
    sent = StreamReport(True, started=1.0, finished=2.0, bytes=11, tiers={"disk": {"bytes": 11}})
    _send(helper_end, {"report": {"ok": True, "started": 1.0, "finished": 2.0, "bytes": 11,
                                  "tiers": {"disk": {"bytes": 11}}}})
    started, finished, detail = exported.arrived()
    assert (started, finished) == (sent.started, sent.finished)
    assert detail == {"bytes": 11, "during_restore": True, "tiers": sent.tiers, "deferred_chunks": 0,
                      "helper_context_s": 0.25}
    assert exported.deferred == frozenset()
    os.close(memory)


def test_the_chunks_the_helper_left_out_arrive_with_its_report():
    helper_end, exported, memory = memory_taken_and_mapped()
    _send(helper_end, {"report": {"ok": True, "started": 1.0, "finished": 2.0, "bytes": 11, "deferred": [0, 1, 2]}})
    assert exported.arrived()[2]["deferred_chunks"] == 3
    assert exported.deferred == frozenset({0, 1, 2})  # the restored process reads them (EMBEDDING_LAST)
    os.close(memory)


def test_arrived_waits_for_the_report():
    helper_end, exported, memory = memory_taken_and_mapped()
    answer = []
    waiting = threading.Thread(target=lambda: answer.append(exported.arrived()))
    waiting.start()
    waiting.join(timeout=0.3)
    assert waiting.is_alive() and not answer  # the memory is mapped, but its weights have not all arrived
    _send(helper_end, {"report": {"ok": True, "started": 1.0, "finished": 2.0, "bytes": 11}})
    waiting.join(timeout=10)
    assert answer and answer[0][1] == 2.0
    os.close(memory)


def test_a_stream_that_fails_after_the_memory_came_is_a_reason():
    helper_end, exported, memory = memory_taken_and_mapped()
    _send(helper_end, {"report": {"ok": False, "reason": "WeightsError: part-00001 chunk 3 fails its check"}})
    assert exported.arrived() is None
    assert "part-00001 chunk 3" in exported.reason
    os.close(memory)


def test_a_helper_that_dies_while_it_streams_is_a_reason():
    helper_end, exported, memory = memory_taken_and_mapped()
    helper_end.close()
    assert exported.arrived() is None and "exited before it reported" in exported.reason
    os.close(memory)


def test_a_restored_process_that_cannot_map_the_memory_lets_the_helper_go():
    helper_end, restored_end = socket.socketpair()
    memory = helper_memory(helper_end)
    exported = ExportedWeights(restored_end)
    exported.take()
    exported.mapped(False)
    assert helper_end.recv(len(ACK)) == b""  # EOF, not the ack: the helper stops and frees its memory
    os.close(memory)


def test_a_helper_that_dies_first_is_a_reason():
    helper_end, restored_end = socket.socketpair()
    helper_end.close()
    exported = ExportedWeights(restored_end)
    assert exported.take() is None and "exited before it reported" in exported.reason
