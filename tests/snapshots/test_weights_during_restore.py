"""The channel between the CUDA restore helper and the restored process (snapshots/weights_during_restore.py),
over real unix sockets: the memory's descriptor arrives intact, and whatever keeps the helper from
streaming reaches the restored process as a reason (it then streams the weights itself). The whole path,
with a real gpu snapshot, is in tests/snapshots/test_gpu_snapshot.py."""

from __future__ import annotations

import os
import socket
import threading

import pytest

from runtime.weights.layout import write_layout
from runtime.weights.manifest import Manifest
from snapshots.weights_during_restore import StreamReport, _send, receive_report, stream_for_handover


def helper_says(layout_dir) -> StreamReport:
    """Run the helper's side on LAYOUT_DIR in a thread, as the helper process does; the restored side's view."""
    helper_end, restored_end = socket.socketpair()
    helper = threading.Thread(target=stream_for_handover, args=(layout_dir, helper_end))
    helper.start()
    report, fd = receive_report(restored_end)
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


def test_the_descriptor_arrives_with_the_report():
    helper_end, restored_end = socket.socketpair()
    memory = os.memfd_create("weights")  # stands in for the exported device memory: any descriptor travels alike
    os.write(memory, b"the weights")
    sent = StreamReport(True, size=4096, started=1.0, finished=2.0, bytes=11, tiers={"disk": {"bytes": 11}})
    _send(helper_end, sent, memory)
    report, fd = receive_report(restored_end)
    assert report == sent
    assert fd is not None and fd != memory
    assert os.pread(fd, 64, 0) == b"the weights"
    os.close(fd)
    os.close(memory)


def test_a_helper_that_dies_is_a_reason():
    helper_end, restored_end = socket.socketpair()
    helper_end.close()
    report, fd = receive_report(restored_end)
    assert not report.ok and "exited without streaming" in report.reason and fd is None
