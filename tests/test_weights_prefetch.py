"""The weights read into the page cache from the entry point's first instruction (runtime/weights/prefetch.py):
a layout dropped from the page cache is back in it, one already there or too large for the memory is left
alone, and a function started from a dropped layout says what it prefetched and serves as without it."""

from __future__ import annotations

import os

import httpx
import pytest

from runtime.weights import prefetch
from runtime.weights.layout import write_layout
from runtime.weights.residency import cached_fraction
from tests.server.conftest import start_server

ENGINE_ENV = {"DEVICE": "cpu", "MAX_MODEL_LEN": "256", "MAX_NUM_SEQS": "4"}


@pytest.fixture
def layout(tiny_model, tmp_path):
    out = tmp_path / "tiny-llama"
    write_layout(tiny_model("tiny-llama"), str(out), dtype="float32", file_bytes=200_000, chunk_bytes=1 << 16,
                 progress=False)
    return out


def weight_files(layout) -> list[str]:
    files = prefetch.layout_files(str(layout))
    assert files and len(files) > 1
    return [path for path, _ in files]


#: the share of bytes just read that a test can count on finding in the page cache: some machines page cold
#: physical memory out on their own (DAMON's pageout, by region), and a region it judged cold may hold pages just
#: read
STILL_CACHED = 0.9


def drop_from_page_cache(paths: list[str]) -> None:
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)  # written pages are dirty until written back: the kernel keeps those
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
    if cached_fraction(paths) is None:
        pytest.skip("this kernel has no cachestat(2) (Linux 6.5+): the page cache cannot be asked")
    if cached_fraction(paths) > 0.5:
        pytest.skip("this machine's page cache keeps the files after POSIX_FADV_DONTNEED")


def test_a_dropped_layout_is_read_back_into_the_page_cache(layout):
    paths = weight_files(layout)
    drop_from_page_cache(paths)
    started = prefetch.start(str(layout))
    assert started is not None and prefetch.skipped is None
    assert started.join(30) and started.error is None
    assert started.bytes == sum(os.path.getsize(p) for p in paths)
    assert cached_fraction(paths) >= STILL_CACHED


def test_prefetch_readers_is_read_as_the_bootstrap_reads_it():
    assert prefetch.readers(None) == prefetch.READERS == 16
    assert prefetch.readers("4") == 4
    for bad in ("0", "-2", "many"):  # the bootstrap's parse of the settings refuses these, and says why
        assert prefetch.readers(bad) == prefetch.READERS


def test_what_is_not_prefetched_and_why(layout, tiny_model, monkeypatch):
    paths = weight_files(layout)
    drop_from_page_cache(paths)
    assert prefetch.start(str(tiny_model("tiny-llama"))) is None  # a Hugging Face directory
    assert prefetch.skipped == "not a local faas-build layout"
    assert prefetch.start("s3://bucket/layout") is None and prefetch.skipped == "not a local faas-build layout"

    available = prefetch.memory_available
    monkeypatch.setattr(prefetch, "memory_available", lambda: 1 << 10)  # a machine with 1 KiB to spare
    assert prefetch.start(str(layout)) is None
    assert prefetch.skipped.endswith("GiB of weights, 0.0 GiB of memory available")
    assert cached_fraction(paths) < 0.5  # nothing was read

    monkeypatch.setattr(prefetch, "memory_available", available)
    for path in paths:
        with open(path, "rb") as f:
            f.read()
    assert prefetch.start(str(layout)) is None and prefetch.skipped == "100% of the weights in the page cache"


def test_a_function_started_from_a_dropped_layout_prefetches_it(layout, tmp_path):
    paths = weight_files(layout)
    for name, env in (("prefetched", {"PREFETCH_READERS": "3"}), ("not", {"PREFETCH_WEIGHTS": "0"})):
        drop_from_page_cache(paths)
        server = start_server(tmp_path, name, MODEL=str(layout), **ENGINE_ENV, **env)
        try:
            server.wait_ready()
            log = server.log()
            if name == "prefetched":
                assert "weights prefetch: reading" in log and "with 3 threads" in log and "GiB in the page cache" in log
                assert "once widened" not in log  # narrowed only beside a restore the entry point began
            else:
                assert "weights prefetch" not in log
            r = httpx.post(f"{server.url}/v1/completions", timeout=60,
                           json={"prompt": "Hello", "max_tokens": 4, "temperature": 0.0})
            assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4
        finally:
            server.stop()
        assert cached_fraction(paths) == 1.0  # read either way: by the prefetch or by the engine


def test_the_read_probe_compares_ways_of_reading_a_layout_or_says_why_not(layout, tmp_path):
    """scripts/probe_weight_read.py: each way asked for reads the whole layout from a dropped page cache (the
    buffered ways leave it cached); a way it cannot parse, or a folder that is no layout, is one line and exit 2."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    repo, out = Path(__file__).resolve().parents[1], tmp_path / "probe.json"
    done = subprocess.run([sys.executable, "scripts/probe_weight_read.py", str(layout), "--ways", "2x1,1x64",
                           "--rounds", "1", "--out", str(out)], cwd=repo, capture_output=True, text=True, timeout=120)
    if done.returncode == 2 and "cannot drop the page cache" in done.stderr:
        pytest.skip(done.stderr.strip())
    assert done.returncode == 0, done.stderr
    report = json.loads(out.read_text())
    assert report["bytes"] == sum(size for _, size in prefetch.layout_files(str(layout)))
    assert set(report["median_s"]) == {"2x1", "1x64"} and min(report["median_s"].values()) > 0
    assert cached_fraction(weight_files(layout)) == 1.0
    for argv, named in ((["--ways", "2y1"], "2y1"), ([], "nowhere")):
        target = str(layout) if argv else str(tmp_path / "nowhere")
        bad = subprocess.run([sys.executable, "scripts/probe_weight_read.py", target, *argv], cwd=repo,
                             capture_output=True, text=True, timeout=60)
        assert bad.returncode == 2 and len(bad.stderr.strip().splitlines()) == 1 and named in bad.stderr
