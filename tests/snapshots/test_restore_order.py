"""RESTORE=auto tries the restore paths in the order faas-build measured (restore-order.json in the snapshot
folder), and says so in /health and the boot log; without a valid measurement, the fixed order."""

from __future__ import annotations

import json

import pytest

from runtime.start_paths import FIXED_ORDER, ORDER_FILE, read_restore_order
from tests.snapshots.test_process_snapshot import boot, health


def measured(**medians: float) -> str:
    return json.dumps({"metric": "spawn_to_first_token_s", "rounds": 3, "order": sorted(medians, key=medians.get),
                       "paths": {p: {"median_s": s, "runs_s": [s] * 3} for p, s in medians.items()}})


def test_the_measured_order_fastest_first_then_the_unmeasured_paths(tmp_path):
    (tmp_path / ORDER_FILE).write_text(measured(gpu=1.64, process=1.52))
    order = read_restore_order(tmp_path)
    assert order.paths == ("process", "gpu", "materialized")
    assert order.report() == {"order": ["process", "gpu", "materialized"], "source": "measured",
                              "seconds": {"process": 1.52, "gpu": 1.64}, "fastest": "process",
                              "ahead_of": "gpu", "ahead_by_s": 0.12}
    assert "process measured fastest by 0.12 s" in order.summary()


@pytest.mark.parametrize("content, reason", [
    (None, "no restore-order.json"),
    ("{not json", "unreadable"),
    (json.dumps({"paths": {}}), "not a valid measurement"),
    (json.dumps({"paths": {"cold": {"median_s": 1.0}}}), "not a valid measurement"),
    (json.dumps({"paths": {"gpu": {"median_s": -1}}}), "not a valid measurement"),
    (json.dumps({"paths": {"gpu": {"median_s": "fast"}}}), "not a valid measurement"),
    ('{"paths": {"gpu": {"median_s": NaN}}}', "not a valid measurement"),
])
def test_without_a_valid_measurement_the_fixed_order(tmp_path, content, reason):
    if content is not None:
        (tmp_path / ORDER_FILE).write_text(content)
    order = read_restore_order(tmp_path)
    assert order.paths == FIXED_ORDER and not order.measured
    assert reason in order.report()["reason"]


@pytest.mark.criu
def test_a_server_reports_the_order_it_tried(snapshot_copy, tiny_model_dir, tmp_path):
    """gpu measured first: skipped (no gpu snapshot), then the process snapshot restored; a broken
    measurement leaves the fixed order, and says why."""
    (snapshot_copy / ORDER_FILE).write_text(measured(gpu=1.2, process=1.9))
    server = boot(tmp_path, tiny_model_dir, snapshot_copy)
    try:
        report = health(server)
        assert report["restore_path"] == "process" and list(report["skipped"]) == ["gpu"]
        assert report["restore_order"] == {"order": ["gpu", "process", "materialized"], "source": "measured",
                                           "seconds": {"gpu": 1.2, "process": 1.9}, "fastest": "gpu",
                                           "ahead_of": "process", "ahead_by_s": 0.7}
    finally:
        assert server.stop() == 0
    assert "gpu measured fastest by 0.70 s" in server.log()

    (snapshot_copy / ORDER_FILE).write_text("{")
    (tmp_path / "again").mkdir()
    server = boot(tmp_path / "again", tiny_model_dir, snapshot_copy)
    try:
        report = health(server)
        assert report["restore_path"] == "process"
        assert report["restore_order"]["source"] == "fixed" and "unreadable" in report["restore_order"]["reason"]
    finally:
        assert server.stop() == 0
