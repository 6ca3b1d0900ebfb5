"""The entry point starts restoring the snapshot the bootstrap would restore first before importing the
bootstrap (snapshots/early_restore.py); the bootstrap's checks take that restore over or undo it."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from runtime.bench.instance import entry_command
from runtime.start_paths import ORDER_FILE
from snapshots import early_restore, handoff
from snapshots.criu import CriuError, find_criu
from snapshots.image import SnapshotImage
from snapshots.restore_run import CRIU_OPTIONS, IMAGES, RestoreRun, kill_tree
from tests.snapshots.test_process_snapshot import cold_text  # noqa: F401  (the module's fixture, shared)
from tests.helpers import children_of, processes_running
from tests.server.conftest import API_KEY, start_server
from tests.snapshots.conftest import ENGINE_ENV
from tests.snapshots.test_process_snapshot import boot, greedy_text, health


def snapshot_dir_with(tmp_path: Path, *kinds: str, order: dict[str, float] | None = None) -> Path:
    for kind in kinds:
        (tmp_path / kind / IMAGES).mkdir(parents=True)
    if order is not None:
        (tmp_path / ORDER_FILE).write_text(json.dumps({"paths": {p: {"median_s": s} for p, s in order.items()}}))
    return tmp_path


@pytest.mark.parametrize("kinds, order, env, argv, expected", [
    (("gpu", "process"), None, {}, [], "gpu"),  # the fixed order
    (("process",), None, {}, [], "process"),  # no gpu snapshot: the next
    (("gpu", "process"), {"process": 0.9, "gpu": 1.3}, {}, [], "process"),  # the measured order
    (("gpu", "process"), {"materialized": 0.5, "process": 0.9}, {}, [], None),  # materialized first: the bootstrap's
    (("gpu", "process"), None, {"RESTORE": "process"}, [], "process"),
    (("gpu", "process"), None, {"RESTORE": "process"}, ["--restore", "cold"], None),  # the flag wins
    (("gpu", "process"), None, {}, ["--restore=gpu"], "gpu"),
    (("gpu", "process"), None, {"EARLY_RESTORE": "0"}, [], None),
    (("gpu", "process"), None, {}, ["--early-restore", "false"], None),
    (("gpu", "process"), None, {"MODEL": "a=/m/a,b=/m/b"}, [], None),  # several models: the bootstrap's
    (("gpu", "process"), None, {"AWS_LAMBDA_RUNTIME_API": "127.0.0.1:9001"}, [], None),
    ((), None, {}, [], None),
])
def test_the_snapshot_started_early_is_the_one_the_bootstrap_tries_first(tmp_path, kinds, order, env, argv,
                                                                         expected):
    directory = snapshot_dir_with(tmp_path, *kinds, order=order)
    assert early_restore.first_kind(argv, {"SNAPSHOT_DIR": str(directory), **env}) == expected


def test_without_a_snapshot_dir_nothing_starts(tmp_path):
    assert early_restore.first_kind([], {}) is None
    assert early_restore.start([], {}) is None


@pytest.mark.criu
def test_a_boot_restores_what_criu_began_before_the_checks(process_snapshot, tiny_model_dir, cold_text,  # noqa: F811
                                                           tmp_path):
    server = boot(tmp_path, tiny_model_dir, process_snapshot)
    try:
        stages = {s["stage"]: s for s in health(server)["stages"]}
        assert health(server)["restore_path"] == "process"
        # CRIU began first, and the check of its image files right after it, in the entry point: before the
        # bootstrap, after its imports, reached the restore
        restore, check = stages["restore"], stages["snapshot_verify"]
        assert restore["start_s"] < check["start_s"] < restore["start_s"] + restore["detail"]["early_s"]
        assert restore["detail"]["early_s"] > 0
        assert greedy_text(server) == cold_text
    finally:
        server.stop()


@pytest.mark.criu
def test_the_image_command_restores_before_site_and_serves_the_same(process_snapshot, tiny_model_dir, cold_text,  # noqa: F811
                                                                  tmp_path):
    server = start_server(tmp_path, "no-site", command=entry_command(), MODEL=str(tiny_model_dir),
                          SNAPSHOT_DIR=str(process_snapshot), API_KEY=API_KEY, **ENGINE_ENV)
    try:
        server.wait_ready()
        stages = {s["stage"]: s for s in health(server)["stages"]}
        assert health(server)["restore_path"] == "process", health(server).get("skipped")
        # CRIU began before site ran, the check of its image after it (with xxhash), both before the bootstrap
        restore, check = stages["restore"], stages["snapshot_verify"]
        assert restore["start_s"] < check["start_s"] < restore["start_s"] + restore["detail"]["early_s"]
        assert greedy_text(server) == cold_text
    finally:
        server.stop()


@pytest.mark.criu
def test_with_early_restore_off_criu_starts_after_the_checks(process_snapshot, tiny_model_dir,
                                                             cold_text, tmp_path):  # noqa: F811
    server = boot(tmp_path, tiny_model_dir, process_snapshot, EARLY_RESTORE="0")
    try:
        stages = {s["stage"]: s for s in health(server)["stages"]}
        assert stages["restore"]["start_s"] >= stages["snapshot_verify"]["start_s"]
        assert "early_s" not in stages["restore"]["detail"] and stages["restore"]["detail"]["before_criu_s"] >= 0
        assert greedy_text(server) == cold_text
    finally:
        server.stop()


@pytest.mark.criu
def test_a_restore_started_early_and_not_taken_is_undone(process_snapshot):
    """What the bootstrap does when its checks refuse the snapshot, or would restore another: the restored
    process is killed once CRIU is done, and nothing of it is left."""
    env = {"SNAPSHOT_DIR": str(process_snapshot), "RESTORE": "process", "LAZY_PAGES": "0"}
    assert early_restore.start([], env) == "process"
    criu = find_criu()
    running = early_restore.take("process", criu.path, process_snapshot / "process" / IMAGES, list(CRIU_OPTIONS))
    assert running is not None and early_restore.take("process", criu.path, "/elsewhere", []) is None
    pid, seconds = running.wait()
    try:
        assert seconds > 0 and Path(f"/proc/{pid}").exists() and pid in children_of(os.getpid())
    finally:  # left running, it would hold the snapshot's handoff name: no later restore of it could run
        running.undo()
    assert pid not in children_of(os.getpid()) and not Path(f"/proc/{pid}").exists()

    assert early_restore.start([], env) == "process"
    try:
        before = set(children_of(os.getpid()))
        assert early_restore.take("gpu", criu.path, process_snapshot / "gpu" / IMAGES, []) is None  # another: undone
        assert set(children_of(os.getpid())) <= before  # CRIU and what it restored are gone
    finally:
        early_restore.abandon()  # nothing left to abandon, unless an assertion failed first


@pytest.mark.criu
def test_a_snapshot_whose_restored_process_still_waits_starts_cold_and_says_why(process_snapshot, tiny_model_dir,
                                                                                 cold_text, tmp_path):  # noqa: F811
    """Two instances restoring one snapshot in one network namespace: the second starts fresh, and its reason
    names the clash rather than only CRIU's failed bind."""
    env = {"SNAPSHOT_DIR": str(process_snapshot), "RESTORE": "process", "LAZY_PAGES": "0"}
    assert early_restore.start([], env) == "process"
    waiting = early_restore.take("process", find_criu().path, process_snapshot / "process" / IMAGES,
                                 list(CRIU_OPTIONS))
    waiting.wait()
    (tmp_path / "second").mkdir(), (tmp_path / "after").mkdir()
    try:
        server = boot(tmp_path / "second", tiny_model_dir, process_snapshot)
        try:
            state = health(server)
            assert state["restore_path"] == "cold"
            assert "another process restored from this snapshot waits for its handoff" in state["skipped"]["process"]
            assert greedy_text(server) == cold_text
        finally:
            server.stop()
    finally:
        waiting.undo()
    assert_next_start_restores(tmp_path / "after", tiny_model_dir, process_snapshot)  # the name is free again


def assert_next_start_restores(tmp_path: Path, model: Path, snapshot_dir: Path) -> None:
    """A start from SNAPSHOT_DIR restores its process snapshot: nothing left behind holds its handoff name."""
    server = boot(tmp_path, model, snapshot_dir)
    try:
        assert health(server)["restore_path"] == "process"
    finally:
        server.stop()


def wait_for_criu_restore(server) -> None:
    """Until SERVER's bootstrap runs `criu restore`."""
    deadline = time.monotonic() + 30
    while not processes_running(b"restore", children_of(server.process.pid)):
        assert server.process.poll() is None and time.monotonic() < deadline, server.log()[-2000:]
        time.sleep(0.001)


@pytest.mark.criu
@pytest.mark.parametrize("command", ["entry", "bootstrap"])
def test_sigterm_while_criu_restores_leaves_nothing_running(process_snapshot, tiny_model_dir, tmp_path, command):
    """A platform may stop an instance while it starts. Stopped then, the bootstrap would leave what CRIU restored
    waiting for a handoff, holding the snapshot's handoff name, and the stop would not reach the runtime."""
    restored = b"snapshots.frozen"  # what a process restored from a snapshot runs
    before = set(processes_running(restored))
    bootstrap = None if command == "entry" else [sys.executable, "-m", "runtime.bootstrap"]
    started = start_server(tmp_path, command, bootstrap, MODEL=str(tiny_model_dir),
                           SNAPSHOT_DIR=str(process_snapshot), API_KEY=API_KEY, **ENGINE_ENV)
    wait_for_criu_restore(started)
    started.process.send_signal(signal.SIGTERM)  # criu restore is running
    # handed over, then stopped by the forwarded signal: drained, or before it served at all
    assert started.process.wait(timeout=60) in (0, 128 + signal.SIGTERM), started.log()[-2000:]
    assert "forwarding SIGTERM, which came during the restore" in started.log()
    assert set(processes_running(restored)) <= before
    assert not handoff.name_taken(SnapshotImage.read(process_snapshot / "process").snapshot_id)
    assert_next_start_restores(tmp_path, tiny_model_dir, process_snapshot)


@pytest.mark.criu
@pytest.mark.parametrize("command", ["entry", "bootstrap"])
def test_a_restored_process_whose_bootstrap_was_killed_exits(process_snapshot, tiny_model_dir, tmp_path, command):
    """SIGKILL cannot be held or forwarded: a bootstrap killed between CRIU's restore and the hand-over (outside
    a container, nothing kills what it restored with it) leaves a process that waits for a handoff no one will
    send. It must exit by itself, and give the snapshot's handoff name back for the next start."""
    real = find_criu().path
    criu = tmp_path / "criu"  # keeps the bootstrap waiting once the restore is done: the window to kill it in
    criu.write_text(f'#!/bin/sh\n{real} "$@"; status=$?; sleep 2; exit $status\n')
    criu.chmod(0o755)
    snapshot_id = SnapshotImage.read(process_snapshot / "process").snapshot_id
    before = set(processes_running(b"snapshots.frozen"))
    bootstrap = None if command == "entry" else [sys.executable, "-m", "runtime.bootstrap"]
    started = start_server(tmp_path, command, bootstrap, MODEL=str(tiny_model_dir), SNAPSHOT_DIR=str(process_snapshot),
                           API_KEY=API_KEY, THAWLLM_CRIU=str(criu), RESTORE="process", **ENGINE_ENV)
    try:
        deadline = time.monotonic() + 60
        # restored (its memory, command line included, is back) and listening; criu has not exited yet
        while not (set(processes_running(b"snapshots.frozen")) - before and handoff.name_taken(snapshot_id)):
            assert started.process.poll() is None and time.monotonic() < deadline, started.log()[-2000:]
            time.sleep(0.005)
        started.process.kill()
        started.process.wait()
        gone_by = time.monotonic() + 2 * handoff.CLAIM_CHECK_S + 1
        while handoff.name_taken(snapshot_id) or set(processes_running(b"snapshots.frozen")) - before:
            assert time.monotonic() < gone_by, "the restored process still waits for its handoff"
            time.sleep(0.05)
    finally:
        for pid in set(processes_running(b"snapshots.frozen")) - before:  # later restores need the name
            kill_tree(pid)
    assert_next_start_restores(tmp_path, tiny_model_dir, process_snapshot)


@pytest.mark.criu
def test_sigterm_while_a_failing_restore_runs_stops_the_start(process_snapshot, tiny_model_dir, tmp_path):
    """Where the restore fails, the start would go on fresh, minutes on a large model, for an instance already
    told to stop: it exits instead."""
    criu = tmp_path / "criu"  # its restores fail, after long enough to be stopped during one
    criu.write_text(f"#!/bin/sh\nif [ \"$1\" = restore ]; then sleep 1; exit 1; fi\nexec {find_criu().path} \"$@\"\n")
    criu.chmod(0o755)
    started = start_server(tmp_path, "boot", MODEL=str(tiny_model_dir), SNAPSHOT_DIR=str(process_snapshot),
                           API_KEY=API_KEY, THAWLLM_CRIU=str(criu), **ENGINE_ENV)
    wait_for_criu_restore(started)
    started.process.send_signal(signal.SIGTERM)
    assert started.process.wait(timeout=60) == 128 + signal.SIGTERM, started.log()[-2000:]
    log = started.log()
    assert "stopped by signal 15 while the start looked for a snapshot or restored one: not starting fresh" in log
    assert "ready: serving" not in log


def interrupt_after(seconds: float) -> None:
    """KeyboardInterrupt in the main thread in SECONDS, as faas-build's SIGTERM raises one (runtime/interrupts.py)."""
    def interrupt(signum, frame):
        raise KeyboardInterrupt

    signal.signal(signal.SIGALRM, interrupt)
    signal.setitimer(signal.ITIMER_REAL, seconds)


@pytest.mark.criu
@pytest.mark.parametrize("when", ["before", "after"])
def test_an_interrupt_while_criu_restores_leaves_nothing_restored(process_snapshot, tmp_path, when):
    """faas-build restores each snapshot it bakes once, to check it. Stopped during that restore, before criu has
    begun (WHEN before) or once it has restored but not yet exited (after), it must not leave the restored process
    waiting for a handoff, holding the snapshot's handoff name, after the build has gone."""
    real = find_criu().path
    criu = tmp_path / "criu"
    criu.write_text(f'#!/bin/sh\nsleep 0.5; exec {real} "$@"\n' if when == "before"
                    else f'#!/bin/sh\n{real} "$@"; status=$?; sleep 1; exit $status\n')
    criu.chmod(0o755)
    snapshot_id = SnapshotImage.read(process_snapshot / "process").snapshot_id
    before = set(children_of(os.getpid()))
    running = RestoreRun(str(criu), process_snapshot / "process" / IMAGES, snapshot_id, CRIU_OPTIONS)
    try:
        deadline = time.monotonic() + 30
        while when == "after" and not handoff.name_taken(snapshot_id):  # restored: listening for its handoff
            assert time.monotonic() < deadline
            time.sleep(0.005)
        interrupt_after(0.1)
        with pytest.raises(KeyboardInterrupt):
            running.wait()
        while processes_running(str(criu).encode(), children_of(os.getpid())):  # a criu left running ends first
            assert time.monotonic() < deadline
            time.sleep(0.01)
        assert not handoff.name_taken(snapshot_id)
        assert not processes_running(b"snapshots.frozen", children_of(os.getpid()))
        assert not Path(running.workdir).exists()
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, signal.SIG_DFL)
        for pid in set(children_of(os.getpid())) - before:  # left behind by a failure: later restores need the name
            kill_tree(pid)
    running.undo()  # the clean-up a caller runs next finds nothing left to undo
    with pytest.raises(CriuError, match="interrupted"):
        running.wait()


@pytest.mark.criu
def test_the_early_check_of_the_image_is_taken_only_against_the_same_digests(process_snapshot):
    image = SnapshotImage.read(process_snapshot / "process")
    images = process_snapshot / "process" / IMAGES
    env = {"SNAPSHOT_DIR": str(process_snapshot), "RESTORE": "process", "LAZY_PAGES": "0"}
    try:
        assert early_restore.start([], env) == "process"
        other = {name: "0" * 32 for name in image.digests}  # a manifest read later that says otherwise
        assert early_restore.take_check(images, other, image.hash) is None
    finally:
        early_restore.abandon()
    try:
        assert early_restore.start([], env) == "process"
        check = early_restore.take_check(images, image.digests, image.hash)
        assert check is not None and early_restore.take_check(images, image.digests, image.hash) is None  # once
        check.wait()  # every file matched
        assert check.bytes == sum(image.files.values())
    finally:
        early_restore.abandon()


def lazy_pages_blocker() -> str | None:
    """Why this kernel cannot restore lazily (criu's own check of userfaultfd), None when it can."""
    criu = find_criu()
    if criu is None:
        return "criu is not installed"
    result = subprocess.run([criu.path, "check", "--feature", "uffd-noncoop"], capture_output=True, text=True)
    return None if result.returncode == 0 else (result.stdout + result.stderr).strip().splitlines()[-1]


@pytest.mark.criu
def test_lazy_pages_hand_over_before_the_memory_is_back_and_serve_the_same(process_snapshot, tiny_model_dir,
                                                                          cold_text, tmp_path):  # noqa: F811
    blocker = lazy_pages_blocker()
    if blocker:
        pytest.skip(f"this kernel cannot restore lazily: {blocker}")
    server = boot(tmp_path, tiny_model_dir, process_snapshot, LAZY_PAGES="1")
    try:
        state = health(server)
        assert state["restore_path"] == "process"
        restore = next(s for s in state["stages"] if s["stage"] == "restore")
        assert restore["detail"]["lazy_pages"] is True
        assert greedy_text(server) == cold_text
        assert "lazy pages: the restored runtime's memory is all back" in server.log()
        assert children_of(server.process.pid) == [restore_pid(server)]  # the daemon is done and reaped
    finally:
        server.stop()


def restore_pid(server) -> int:
    line = next(line for line in server.log().splitlines() if "CRIU restored pid" in line)
    return int(line.split("CRIU restored pid ")[1].split()[0])


@pytest.mark.criu
def test_without_userfaultfd_lazy_pages_leave_a_plain_restore(process_snapshot, tiny_model_dir,
                                                              cold_text, tmp_path):  # noqa: F811
    """A kernel without userfaultfd, where criu's lazy-pages daemon cannot start: the restore goes on without it."""
    criu = tmp_path / "criu"
    refuse = "echo 'Error (criu/uffd.c:1): uffd: no userfaultfd' >&2; exit 1"
    criu.write_text(f"#!/bin/sh\nif [ \"$1\" = lazy-pages ]; then {refuse}; fi\nexec {find_criu().path} \"$@\"\n")
    criu.chmod(0o755)
    server = boot(tmp_path, tiny_model_dir, process_snapshot, LAZY_PAGES="1", THAWLLM_CRIU=str(criu))
    try:
        state = health(server)
        assert state["restore_path"] == "process"
        assert next(s for s in state["stages"] if s["stage"] == "restore")["detail"]["lazy_pages"] is False
        assert "restored without lazy pages: criu lazy-pages exited 1" in server.log()
        assert greedy_text(server) == cold_text
    finally:
        server.stop()


@pytest.mark.criu
def test_a_lazy_pages_daemon_that_fails_takes_the_restored_runtime_down(process_snapshot, tiny_model_dir,
                                                                        tmp_path):
    """Part of its memory may never have come back: the runtime must not go on serving."""
    blocker = lazy_pages_blocker()
    if blocker:
        pytest.skip(f"this kernel cannot restore lazily: {blocker}")
    criu = tmp_path / "criu"  # the daemon does its work, then fails
    criu.write_text(f"#!/bin/sh\nif [ \"$1\" = lazy-pages ]; then {find_criu().path} \"$@\"; exit 3; fi\n"
                    f"exec {find_criu().path} \"$@\"\n")
    criu.chmod(0o755)
    server = start_server(tmp_path, "boot", MODEL=str(tiny_model_dir), SNAPSHOT_DIR=str(process_snapshot),
                          API_KEY=API_KEY, LAZY_PAGES="1", THAWLLM_CRIU=str(criu), **ENGINE_ENV)
    try:
        assert server.process.wait(timeout=120) == 128 + 9  # the restored runtime was killed
        assert "lazy pages: the daemon filling the restored runtime's memory failed (3): stopping it" in server.log()
    finally:
        server.stop()
