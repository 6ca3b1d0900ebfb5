"""faas-bench end to end on CPU: both subcommands against the tiny model, run as a user runs them (a child
process), with real servers started per mode. Structure and sensible ordering are asserted, never speed."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from runtime.bench.plots import assign_lanes
from runtime.bench.workload import WorkloadShape, make_workload
from tests.helpers import children_of

REPO = Path(__file__).resolve().parents[1]
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
SNAPSHOT_MODES = ("gpu", "process", "materialized")


def faas_bench(*args: str, timeout: float = 240) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "runtime.bench.cli", *args], cwd=REPO, capture_output=True,
                          text=True, timeout=timeout)


@pytest.fixture(scope="module")
def coldstart(tiny_model, tmp_path_factory):
    out = tmp_path_factory.mktemp("coldstart")
    done = faas_bench("coldstart", "--model", tiny_model("tiny-llama"), "--device", "cpu", "--repeat", "1",
                      "--max-tokens", "2", "--out", str(out))
    assert done.returncode == 0, done.stderr[-3000:]
    return out, done.stdout


def test_coldstart_times_every_mode_that_runs_on_cpu(coldstart):
    out, stdout = coldstart
    report = json.loads((out / "coldstart.json").read_text())
    modes = report["modes"]
    assert list(modes) == ["gpu", "process", "materialized", "cold", "transformers"]
    for mode in ("cold", "transformers"):
        assert modes[mode]["status"] == "ok", modes[mode]
        (run,) = modes[mode]["runs"]
        assert run["prompt_tokens"] == 161
        assert 0 < run["spawn_to_ready_s"] < run["spawn_to_first_token_s"]
        names = [s["stage"] for s in run["stages"]]
        assert {"runtime_init", "weights", "first_token"} <= set(names)
        for stage in run["stages"]:
            assert 0 <= stage["start_s"] <= stage["end_s"] <= run["spawn_to_first_token_s"] + 1e-3
        summary = modes[mode]["summary"]["spawn_to_first_token_s"]
        assert summary["min"] == summary["median"] == summary["max"] == run["spawn_to_first_token_s"]
    assert modes["cold"]["runs"][0]["restore_path"] == "cold"
    for mode in ("cold", "transformers"):  # what each start read from disk: counted, whatever the page cache
        assert modes[mode]["runs"][0]["disk_read_bytes"] >= 0
    # a server's start until its answer too, which is part of it
    assert 0 <= modes["cold"]["runs"][0]["disk_read_to_answer_bytes"] <= modes["cold"]["runs"][0]["disk_read_bytes"]
    assert "read to exit" not in stdout  # a column for starts from a dropped page cache only


def test_coldstart_reports_modes_without_a_snapshot_as_skipped_with_the_servers_reason(coldstart):
    out, stdout = coldstart
    modes = json.loads((out / "coldstart.json").read_text())["modes"]
    for mode in SNAPSHOT_MODES:  # no SNAPSHOT_DIR: the server falls back to cold and says why
        assert modes[mode]["status"] == "skipped"
        assert modes[mode]["runs"] == []
        assert "SNAPSHOT_DIR" in modes[mode]["reason"]
        assert f"| {mode} | 0 | skipped: " in stdout


def test_coldstart_writes_a_pasteable_table_and_the_figure(coldstart):
    out, stdout = coldstart
    table = (out / "coldstart.md").read_text()
    assert table.strip() in stdout
    rows = [line for line in table.splitlines() if line.startswith("| ") and "---" not in line]
    assert [row.split("|")[1].strip() for row in rows[1:]] == ["gpu", "process", "materialized", "cold",
                                                               "transformers"]
    png = (out / "coldstart.png").read_bytes()
    assert png.startswith(PNG_MAGIC) and len(png) > 10_000


def test_trace_measures_ttft_including_the_cold_start_of_each_instance(tiny_model, tmp_path):
    done = faas_bench("trace", "--model", tiny_model("tiny-llama"), "--device", "cpu", "--modes", "cold",
                      "--rates", "1,3", "--duration", "3", "--length-scale", "0.05", "--max-instances", "2",
                      "--slots", "2", "--queue-threshold", "1", "--out", str(tmp_path))
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads((tmp_path / "trace.json").read_text())
    assert [(p["mode"], p["rate"]) for p in report["points"]] == [("cold", 1.0), ("cold", 3.0)]
    for point in report["points"]:
        assert point["status"] == "ok", point
        assert point["requests"] == point["completed"] == len(point["ttfts_s"]) > 0
        assert point["error_count"] == 0
        assert 0 < point["ttft_p50_s"] <= point["ttft_p99_s"] <= max(point["ttfts_s"])
        # the gaps between one streamed token and the next: far below a whole request's time to first token
        assert 0 < point["itl_p50_s"] <= point["itl_p99_s"] < point["ttft_p99_s"]
        assert point["throughput_rps"] > 0 and point["output_tokens_per_s"] > 0
        assert 1 <= len(point["instances"]) <= 2
        assert all(i["restore_path"] == "cold" for i in point["instances"] if i["spawn_to_ready_s"])
        # the pool starts empty: the first request waits for a whole cold start
        first_ready = min(i["spawn_to_ready_s"] for i in point["instances"] if i["spawn_to_ready_s"])
        assert point["ttfts_s"][0] >= first_ready
    # at 3 requests/s three requests wait within 0.5 s, long before a first start ends: a second is started
    assert len(report["points"][1]["instances"]) == 2
    assert (tmp_path / "trace.png").read_bytes().startswith(PNG_MAGIC)
    assert "| cold | 3 |" in done.stdout and "p99 ITL (ms)" in done.stdout
    assert "clashes" not in done.stderr  # cold instances restore nothing


def test_a_trace_that_would_restore_one_snapshot_twice_at_once_says_so_before_it_starts(tiny_model, tmp_path):
    done = faas_bench("trace", "--model", tiny_model("tiny-llama"), "--device", "cpu", "--modes", "process",
                      "--rates", "1", "--requests", "1", "--length-scale", "0.05", "--max-instances", "2",
                      "--out", str(tmp_path))
    assert done.returncode == 0, done.stderr[-3000:]  # no snapshot here: the mode is skipped, not failed
    warning = [line for line in done.stderr.splitlines() if "clashes" in line]
    assert len(warning) == 1 and "--instance-snapshot-dirs" in warning[0]


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return False
    return state != "Z"


def test_a_stopped_trace_keeps_its_finished_points_stops_its_servers_and_merges_with_another_run(tiny_model, tmp_path):
    common = ["--model", tiny_model("tiny-llama"), "--device", "cpu", "--requests", "4", "--length-scale", "0.05",
              "--max-instances", "1"]
    first, second, merged = tmp_path / "cold", tmp_path / "process", tmp_path / "merged"
    bench = subprocess.Popen([sys.executable, "-m", "runtime.bench.cli", "trace", *common, "--modes", "cold",
                              "--rates", "4,5", "--out", str(first)], cwd=REPO, stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 120
    while not ((first / "logs" / "trace-cold-5").exists() and (servers := children_of(bench.pid))):
        assert bench.poll() is None and time.monotonic() < deadline, bench.communicate()
        time.sleep(0.05)
    bench.send_signal(signal.SIGTERM)  # what `timeout` sends: the second rate's server is starting or serving
    _, err = bench.communicate(timeout=90)
    assert bench.returncode == 128 + signal.SIGTERM and "stopped by SIGTERM" in err, err[-2000:]
    assert not any(_alive(pid) for pid in servers)
    report = json.loads((first / "trace.json").read_text())
    assert [(p["mode"], p["rate"], p["status"], p["completed"]) for p in report["points"]] == [("cold", 4.0, "ok", 4)]
    assert (first / "trace.png").read_bytes().startswith(PNG_MAGIC)

    # where a part's snapshots come from is its own: this one's instances each get a directory (empty here)
    (tmp_path / "no-snapshots").mkdir()
    done = faas_bench("trace", *common, "--modes", "process", "--rates", "4", "--out", str(second),
                      "--instance-snapshot-dirs", str(tmp_path / "no-snapshots"))
    assert done.returncode == 0, done.stderr[-3000:]
    merge = [sys.executable, "scripts/merge_trace.py", str(first / "trace.json"), str(second / "trace.json")]
    done = subprocess.run([*merge, "--out", str(merged)], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    report = json.loads((merged / "trace.json").read_text())
    assert [(p["mode"], p["rate"], p["status"]) for p in report["points"]] == [  # in the bench's order of modes
        ("process", 4.0, "skipped"), ("cold", 4.0, "ok")]
    assert [part["argv"][part["argv"].index("--modes") + 1] for part in report["parts"]] == ["cold", "process"]
    table = (merged / "trace.md").read_text()
    assert table.count("`faas-bench trace ") == 2 and "| cold | 4 | 4 | 4 |" in table
    assert (merged / "trace.png").read_bytes().startswith(PNG_MAGIC)

    other_seed = json.loads((second / "trace.json").read_text()) | {"seed": 1}
    (tmp_path / "other-seed.json").write_text(json.dumps(other_seed))
    for parts, message in (([first / "trace.json", tmp_path / "other-seed.json"], "differ in seed"),
                           ([first / "trace.json", first / "trace.json"], "is in both")):
        done = subprocess.run([sys.executable, "scripts/merge_trace.py", *map(str, parts), "--out",
                               str(tmp_path / "refused")], cwd=REPO, capture_output=True, text=True, timeout=120)
        assert done.returncode == 2 and message in done.stderr and done.stderr.count("\n") == 1, done.stderr
        assert not (tmp_path / "refused").exists()


@pytest.mark.parametrize("args, message", [
    (["coldstart", "--model", "/no/such/model"], "no such file or directory"),
    (["coldstart", "--set", "MAX_MODEL_LEN"], "NAME=VALUE"),
    (["trace", "--set", "MAX_MODEL_LEN=-3"], "MAX_MODEL_LEN='-3'"),
    # three instances at the default share (0.9) of one GPU cannot all start, nor five at a quarter each
    (["trace", "--device", "cuda", "--max-instances", "3"], "GPU_MEMORY_UTILIZATION=0.9"),
    (["trace", "--device", "cuda", "--max-instances", "5", "--set", "GPU_MEMORY_UTILIZATION=0.25"], "5 instances"),
    # restores running at once need a snapshot directory each
    (["trace", "--max-instances", "3", "--instance-snapshot-dirs", "tests,runtime"], "gives 2 directories"),
    (["trace", "--instance-snapshot-dirs", "/no/such/dir"], "no such directory: /no/such/dir"),
])
def test_bad_input_fails_with_one_line(tmp_path, args, message):
    done = faas_bench(*args, "--out", str(tmp_path))
    assert done.returncode == 2
    assert done.stderr.startswith("faas-bench: ") and message in done.stderr
    assert done.stderr.count("\n") == 1
    assert not any(tmp_path.iterdir())


def test_workload_lengths_have_sharegpt_means_and_fit_the_context():
    requests = make_workload(WorkloadShape(rate=50, duration_s=400, max_len=2048, seed=3))
    assert abs(len(requests) / 400 - 50) < 2.5  # Poisson arrivals at the asked rate
    assert all(b.arrival_s > a.arrival_s for a, b in zip(requests, requests[1:]))
    prompt_mean = sum(r.prompt_tokens for r in requests) / len(requests)
    output_mean = sum(r.output_tokens for r in requests) / len(requests)
    assert abs(prompt_mean - 161) < 8 and abs(output_mean - 338) < 17
    assert all(r.prompt_tokens + r.output_tokens <= 2048 and r.output_tokens >= 1 for r in requests)
    shorter = make_workload(WorkloadShape(rate=50, duration_s=10, max_len=2048, seed=3))
    assert shorter == requests[:len(shorter)]  # seeded: the same trace, cut shorter
    counted = make_workload(WorkloadShape(rate=50, duration_s=None, max_len=2048, seed=3, count=300))
    assert counted == requests[:300]  # a number of requests instead of a duration: the same stream, cut there


def test_overlapping_stages_are_drawn_on_separate_lanes_of_a_bar():
    stages = [{"start_s": 0.0, "end_s": 1.0}, {"start_s": 1.0, "end_s": 3.0},  # end to end: one lane
              {"start_s": 1.5, "end_s": 2.5},  # under the weights: a second lane
              {"start_s": 3.0, "end_s": 3.2}]
    assert assign_lanes(stages) == [0, 0, 1, 0]


def test_a_server_that_cannot_start_is_reported_failed_with_its_error(tmp_path):
    not_a_model = tmp_path / "empty"
    not_a_model.mkdir()
    done = faas_bench("coldstart", "--model", str(not_a_model), "--device", "cpu", "--modes", "cold,transformers",
                      "--repeat", "2", "--out", str(tmp_path / "out"))
    assert done.returncode == 1, done.stderr[-3000:]
    modes = json.loads((tmp_path / "out" / "coldstart.json").read_text())["modes"]
    assert modes["cold"]["status"] == "failed"
    assert modes["cold"]["reason"].startswith("the cold server failed to start: ")  # then the server's error
    assert modes["transformers"]["status"] == "skipped" and "Hugging Face" in modes["transformers"]["reason"]
    assert (tmp_path / "out" / "coldstart.png").read_bytes().startswith(PNG_MAGIC)


def test_serving_bench_runs_in_its_small_cpu_mode_and_writes_every_figure(tmp_path):
    from scripts.model_shapes import make_random_model_dir

    model = make_random_model_dir(tmp_path / "tiny", "tiny")  # as scripts/gpu_suite.sh gives it the real shapes
    out = tmp_path / "serving.json"
    done = subprocess.run(
        [sys.executable, "scripts/bench_serving.py", "--device", "cpu", "--model", str(model), "--batch", "1", "3",
         "--max-len", "128", "--system-tokens", "160", "--questions", "2", "--streams", "2", "--long-tokens", "200",
         "--long-prompts", "1", "--budget", "48", "--max-model-len", "512", "--out", str(out)],
        cwd=REPO, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    (result,) = json.loads(out.read_text())["results"]
    assert result["shape"] == "tiny" and result["engine_config"]["device"] == "cpu"
    assert [t["batch"] for t in result["throughput"]] == [1, 3]
    assert all(t["engine"]["output_tok_s"] > 0 and t["transformers"]["output_tok_s"] > 0
               for t in result["throughput"])
    prefix = result["prefix"]
    assert prefix["cached"]["cached_tokens"] == [160, 160] and prefix["uncached"]["cached_tokens"] == [0, 0]
    assert prefix["cached_eager"]["cached_tokens"] == [160, 160]
    assert result["mix"]["chunked"]["budget"] == 48 and result["mix"]["whole"]["budget"] == 202
    assert result["mix"]["chunked"]["gaps"] > 0
    assert "TTFT cached ms" in done.stdout and "ITL p99 ms" in done.stdout and "progress" not in done.stdout
    assert "engine batch 3" in done.stderr  # progress while it runs



def test_the_disk_read_reference_reads_every_byte_of_the_model_each_time_or_says_why_not(tmp_path):
    from runtime.bench.disk_read import DiskRead, read_files

    sizes = [3 * 2**20 + 17, 1, 70 * 2**20]  # pieces of 64 MiB: one file spans two
    for i, size in enumerate(sizes):
        (tmp_path / f"w{i}.bin").write_bytes(bytes([i + 1]) * size)
    files = sorted(tmp_path.glob("*.bin"))
    assert read_files(files, threads=3) == sum(sizes)
    reference = DiskRead.of(tmp_path, thread_counts=(1, 2))
    assert reference.bytes == sum(sizes)
    why_not = reference.read_once() or reference.read_once() or reference.read_once()
    if why_not:  # not root: the page cache cannot be dropped, and the run says so
        assert "cannot drop the page cache" in why_not and not reference.seconds
        return
    assert [len(reads) for reads in reference.seconds.values()] == [3, 3]
    # the fastest thread count's median, and the fastest of the latest round
    assert reference.best_s == min(sorted(reads)[1] for reads in reference.seconds.values())
    assert reference.latest_best_s() == min(reads[-1] for reads in reference.seconds.values())
    record = reference.as_dict()
    assert record["reads_by_threads"]["2"] == [round(s, 4) for s in reference.seconds[2]]
    assert "(median of 3, " in reference.summary()


def file_on_disk_only(tmp_path, size: int):
    """A file of SIZE random bytes written out and dropped from the page cache: reading it reads the disk. Skips
    where the machine's disks are not counted or its page cache keeps the file."""
    import os

    from runtime.bench.disk_read import bytes_read_from_disks
    from runtime.weights.residency import cached_fraction

    if not bytes_read_from_disks():
        pytest.skip("no physical disk in /sys/block, or no /proc/diskstats")
    path = tmp_path / "weights.bin"
    path.write_bytes(os.urandom(size))
    fd = os.open(path, os.O_RDONLY)
    os.fsync(fd)
    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    os.close(fd)
    if (cached_fraction([str(path)]) or 0.0) > 0.1:
        pytest.skip("this machine's page cache keeps the file after POSIX_FADV_DONTNEED")
    return path


def test_what_a_start_reads_from_disk_is_counted(tmp_path):
    """The kernel's count of bytes read from the machine's disks grows by at least a file read from disk."""
    from runtime.bench.disk_read import bytes_read_from_disks

    path = file_on_disk_only(tmp_path, 16 << 20)
    before = bytes_read_from_disks()
    assert len(path.read_bytes()) == 16 << 20
    assert bytes_read_from_disks() - before >= 16 << 20


def test_the_disk_sampler_sees_a_command_read_and_summarizes_it_or_says_why_not(tmp_path):
    """scripts/sample_disk_queue.py around a command that reads a file from disk: its samples count those bytes,
    its summary finds the busy stretch, the command's exit status is its own; bad input is one line and exit 2."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    path = file_on_disk_only(tmp_path, 64 << 20)
    repo, out = Path(__file__).resolve().parents[1], tmp_path / "queue.json"
    reader = f"import sys, time; time.sleep(0.4); open({str(path)!r}, 'rb').read(); time.sleep(0.4); sys.exit(3)"
    done = subprocess.run([sys.executable, "scripts/sample_disk_queue.py", "--every", "0.02", "--out", str(out),
                           "--", sys.executable, "-c", reader], cwd=repo, capture_output=True, text=True, timeout=120)
    assert done.returncode == 3, done.stderr
    record = json.loads(out.read_text())
    samples = record["samples"]
    assert record["began_at"] > 0 and len(samples) >= 10
    assert samples[-1][2] - samples[0][2] >= 64 << 20  # bytes read over the command's life
    summary = subprocess.run([sys.executable, "scripts/sample_disk_queue.py", "--summarize", str(out), "--plot",
                              str(tmp_path / "queue.png")], cwd=repo, capture_output=True, text=True, timeout=60)
    assert summary.returncode == 0 and summary.stdout.startswith("| part |")
    assert (tmp_path / "queue.png").read_bytes()[:4] == b"\x89PNG"
    rows = [line for line in summary.stdout.splitlines()[2:] if line.startswith("| whole |")]
    assert rows and max(float(row.split("|")[5]) for row in rows) >= 0.06  # GiB in the stretch that read the file
    for argv, says in ((["--out", str(out)], "give a command"), (["--summarize", str(path)], "not samples")):
        bad = subprocess.run([sys.executable, "scripts/sample_disk_queue.py", *argv], cwd=repo, capture_output=True,
                             text=True, timeout=60)
        assert bad.returncode == 2 and len(bad.stderr.strip().splitlines()) == 1 and says in bad.stderr


def test_the_process_sampler_charges_a_read_to_the_child_that_made_it_not_to_its_parent(tmp_path):
    """scripts/sample_reads_by_process.py around a command whose child reads a file from disk: the child's own
    count holds those bytes, its parent's own count (the kernel adds a reaped child's reads to it) does not, the
    command's exit status is its own; bad input is one line and exit 2."""
    path = file_on_disk_only(tmp_path, 32 << 20)
    repo, out = Path(__file__).resolve().parents[1], tmp_path / "reads.json"
    child = f"open({str(path)!r}, 'rb').read()"
    parent = (f"import subprocess, sys, time; time.sleep(0.2); subprocess.run([sys.executable, '-c', {child!r}, "
              f"'reader']); time.sleep(0.2); sys.exit(3)")
    done = subprocess.run([sys.executable, "scripts/sample_reads_by_process.py", "--every", "0.01", "--out", str(out),
                           "--", sys.executable, "-c", parent], cwd=repo, capture_output=True, text=True, timeout=120)
    assert done.returncode == 3, done.stderr
    record = json.loads(out.read_text())
    sys.path.insert(0, str(repo / "scripts"))
    from sample_reads_by_process import own_reads

    rows = {p["command"]: (own, counted, p["pid"]) for own, counted, p in own_reads(record["processes"])}
    (reader,) = [v for k, v in rows.items() if k.endswith(" reader")]
    (command,) = [v for k, v in rows.items() if k.startswith(f"{sys.executable} -c import subprocess")]
    assert reader[0] >= 32 << 20
    assert command[1] >= 32 << 20 and command[0] < 16 << 20
    summary = subprocess.run([sys.executable, "scripts/sample_reads_by_process.py", "--summarize", str(out)],
                             cwd=repo, capture_output=True, text=True, timeout=60)
    assert summary.returncode == 0
    (row,) = [line for line in summary.stdout.splitlines() if line.split("|")[5:6] == [f" {reader[2]} "]]
    assert float(row.split("|")[1]) >= 32
    for argv, says in ((["--out", str(out)], "give --out FILE"), (["--summarize", str(path)], "cannot read")):
        bad = subprocess.run([sys.executable, "scripts/sample_reads_by_process.py", *argv], cwd=repo,
                             capture_output=True, text=True, timeout=60)
        assert bad.returncode == 2 and len(bad.stderr.strip().splitlines()) == 1 and says in bad.stderr


def test_the_process_sampler_takes_an_orphans_reads_from_the_reaper_that_reaped_it(tmp_path):
    """As a restored runtime is criu's child and then, criu gone, the bootstrap's (a subreaper): a reader whose
    parent exits before it reads is charged its reads, and the subreaper that reaps it is not."""
    path = file_on_disk_only(tmp_path, 32 << 20)
    repo, out = Path(__file__).resolve().parents[1], tmp_path / "reads.json"
    scripts = {"orphan": f"import time; time.sleep(0.3); open({str(path)!r}, 'rb').read()",
               "middle": f"import subprocess, sys; subprocess.Popen([sys.executable, {str(tmp_path / 'orphan.py')!r}])",
               "reaper": ("import ctypes, os, subprocess, sys, time; ctypes.CDLL(None).prctl(36, 1, 0, 0, 0); "
                          f"subprocess.run([sys.executable, {str(tmp_path / 'middle.py')!r}]); os.wait(); "
                          "time.sleep(0.2)")}
    for name, code in scripts.items():
        (tmp_path / f"{name}.py").write_text(code)
    done = subprocess.run([sys.executable, "scripts/sample_reads_by_process.py", "--every", "0.01", "--out", str(out),
                           "--", sys.executable, str(tmp_path / "reaper.py")], cwd=repo, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    sys.path.insert(0, str(repo / "scripts"))
    from sample_reads_by_process import own_reads

    rows = {Path(p["command"].split()[-1]).stem: (own, counted, p) for own, counted, p in own_reads(
        json.loads(out.read_text())["processes"]) if p["command"].startswith(f"{sys.executable} {tmp_path}")}
    assert rows["orphan"][0] >= 32 << 20 and rows["orphan"][2]["ppid"] == rows["reaper"][2]["pid"]
    assert rows["reaper"][1] >= 32 << 20 and rows["reaper"][0] < 16 << 20


def test_the_stack_sampler_says_where_a_named_thread_of_a_watched_process_waits(tmp_path):
    """scripts/sample_thread_stacks.py around a command whose named thread sleeps: the watched process is
    sampled with each thread's kernel wait channel (and, where py-spy is on the PATH, the summary names the
    thread's Python frames), the sampler itself is not; the command's exit status is its own; bad input is one
    line and exit 2."""
    import shutil

    repo, out = Path(__file__).resolve().parents[1], tmp_path / "stacks.json"
    code = ("import sys, threading, time; t = threading.Thread(target=time.sleep, args=(1.5,), name='napper'); "
            "t.start(); t.join(); sys.exit(3)  # watched-by-the-test")
    done = subprocess.run([sys.executable, "scripts/sample_thread_stacks.py", "--match", "watched-by-the-test",
                           "--every", "0.2", "--out", str(out), "--", sys.executable, "-c", code], cwd=repo,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 3, done.stderr
    samples = json.loads(out.read_text())["samples"]
    assert samples and len({s["pid"] for s in samples}) == 1  # its own command line holds the match too
    waits = [t["wchan"] for s in samples for t in s["threads"].values()]
    assert len(samples[-1]["threads"]) >= 2 and any("sleep" in w or "futex" in w for w in waits)
    summary = subprocess.run([sys.executable, "scripts/sample_thread_stacks.py", "--summarize", str(out), "--thread",
                              "napper"], cwd=repo, capture_output=True, text=True, timeout=60)
    assert summary.returncode == 0
    if shutil.which("py-spy"):
        assert "time_sleep" in summary.stdout or "sleep" in summary.stdout
    for argv, says in ((["--out", str(out)], "give --match"), (["--summarize", str(tmp_path)], "sample_thread_stacks")):
        bad = subprocess.run([sys.executable, "scripts/sample_thread_stacks.py", *argv], cwd=repo,
                             capture_output=True, text=True, timeout=60)
        assert bad.returncode == 2 and len(bad.stderr.strip().splitlines()) == 1 and says in bad.stderr


def test_the_coldstart_table_says_what_starts_from_a_dropped_page_cache_read(tmp_path):
    from runtime.bench.records import ModeResult, StartRun
    from runtime.bench.report import coldstart_json, coldstart_table

    def start(first_token_s: float, read: int | None, to_answer: int | None, reference_s: float) -> StartRun:
        return StartRun("process", "process", first_token_s - 0.1, first_token_s, [], 161, "dropped", read, to_answer,
                        reference_s)

    runs = [start(9.9, 16 << 30, 15 << 30, 9.0), start(10.0, 17 << 30, 16 << 30, 8.0),
            start(10.2, None, None, 10.2)]
    table = coldstart_table([ModeResult("process", runs=runs)])
    head, _, row = table.splitlines()
    # each start over its own round's reference read; the medians of the runs that counted, until the answer,
    # then until the exit
    assert "| over the round's reference read, median (min-max) | read to answer (GiB) | read to exit (GiB) |" in head
    assert "| 1.100 (1.00-1.25) | 15.50 | 16.50 |" in row
    summary = coldstart_json([ModeResult("process", runs=runs)], {})["modes"]["process"]["summary"]
    assert summary["over_reference_read"] == {"median": 1.1, "min": 1.0, "max": 1.25}
    assert summary["disk_read_gib"] == {"median": 16.5, "min": 16.0, "max": 17.0}
    assert summary["disk_read_to_answer_gib"] == {"median": 15.5, "min": 15.0, "max": 16.0}


def test_a_coldstart_from_a_dropped_page_cache_reads_the_reference_in_every_round(tiny_model, tmp_path):
    """From a dropped page cache the model is read at the disk's rate before each round's starts, and each
    start is held against its own round's fastest read."""
    done = faas_bench("coldstart", "--model", tiny_model("tiny-llama"), "--device", "cpu", "--modes", "cold",
                      "--repeat", "2", "--max-tokens", "2", "--page-cache", "dropped", "--out", str(tmp_path))
    assert done.returncode == 0, done.stderr[-3000:]
    if "cannot drop the page cache" in done.stderr:
        pytest.skip("not permitted to drop the page cache here (not root)")
    report = json.loads((tmp_path / "coldstart.json").read_text())
    reads = report["disk_read"]["reads_by_threads"]
    assert sorted(map(int, reads)) == [8, 16] and all(len(times) == 2 for times in reads.values())
    runs = report["modes"]["cold"]["runs"]
    assert [run["page_cache"] for run in runs] == ["dropped", "dropped"]
    for i, run in enumerate(runs):  # the fastest thread count's read of the run's own round
        assert run["reference_read_s"] == min(times[i] for times in reads.values())
    assert done.stderr.count("the reference read, run") == 2  # progress, round by round
    assert "over the round's reference read" in done.stdout and "(median of 2, " in done.stdout


def test_replot_draws_a_committed_runs_figure_from_its_json_and_refuses_bad_input(tmp_path):
    repo = Path(__file__).resolve().parents[1]
    out = tmp_path / "coldstart.png"
    run = subprocess.run([sys.executable, "scripts/replot.py", "coldstart",
                          "docs/benchmarks/coldstart-h200-llama-3-8b.json", str(out)],
                         cwd=repo, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    bad = subprocess.run([sys.executable, "scripts/replot.py", "switch", str(tmp_path / "missing.json"),
                          str(tmp_path / "also-missing.json"), str(tmp_path / "s.png")],
                         cwd=repo, capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and len(bad.stderr.strip().splitlines()) == 1 and "missing.json" in bad.stderr


def log_timeline(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "scripts/coldstart_log_timeline.py", *args], cwd=REPO,
                          capture_output=True, text=True, timeout=60)


def timeline_rows(stdout: str) -> list[dict[str, str]]:
    lines = [line for line in stdout.splitlines() if line.startswith("| ") and not line.startswith("| ---")]
    header = [cell.strip() for cell in lines[0].strip("|").split("|")]
    return [dict(zip(header, (cell.strip() for cell in line.strip("|").split("|")))) for line in lines[1:]]


def test_the_log_timeline_reads_every_start_of_a_run_from_its_boot_logs(coldstart, tmp_path):
    """scripts/coldstart_log_timeline.py: a fresh run's logs (warm, on CPU: nothing read ahead), a committed cold-disk
    run's (the prefetch narrowed in one arm and not in the other), and bad input, one line and exit 2."""
    out, _ = coldstart
    done = log_timeline(str(out / "coldstart.json"))
    assert done.returncode == 0, done.stderr
    (cold,) = [row for row in timeline_rows(done.stdout) if row["mode"] == "cold"]
    assert float(cold["ready"]) < float(cold["spawn_to_first_token"])
    assert cold["start_pages_s"] == cold["prefetch_end"] == cold["widened_after_s"] == ""  # warm: nothing read

    # its logs in <name>-logs/
    done = log_timeline("docs/benchmarks/coldstart-h200-llama-3-8b-dropped-wide-restore.json")
    assert done.returncode == 0, done.stderr
    rows = timeline_rows(done.stdout)
    assert [row["mode"] for row in rows] == ["process"] * 6 + ["process-wide-restore"] * 6
    for row in rows:
        narrowed = row["mode"] == "process"
        assert (row["widened_after_s"] != "") == narrowed
        assert float(row["prefetch_end"]) <= float(row["ready"]) < float(row["spawn_to_first_token"])
        assert float(row["restore_end"]) < float(row["helper_stream_start"]) < float(row["ready"])
    assert "process (median of 6): spawn_to_first_token 9.797" in done.stdout
    assert {row["prefetch_over_reference_s"] for row in rows} == {""}  # read its reference once, before the starts

    # a run that read the reference every round: how much longer than it the prefetch took, start by start
    run = "docs/benchmarks/coldstart-h200-llama-3-8b-dropped-table-last.json"
    done = log_timeline(run)
    assert done.returncode == 0, done.stderr
    references = [r["reference_read_s"] for r in json.loads((REPO / run).read_text())["modes"]["process"]["runs"]]
    rows = timeline_rows(done.stdout)
    table_last = [row for row in rows if row["mode"] == "process"]
    assert len(table_last) == len(references) == 5
    for row, reference in zip(table_last, references):
        over = float(row["prefetch_over_reference_s"])
        assert float(row["prefetch_end"]) - over == pytest.approx(reference, abs=2e-3)
    # the first token against the prefetch's last read: before it with the table read last, after it without
    for row in rows:
        answer = float(row["answer_after_prefetch_s"])
        assert answer == pytest.approx(float(row["spawn_to_first_token"]) - float(row["prefetch_end"]), abs=2e-3)
        assert (answer < 0) == (row["mode"] == "process")

    (tmp_path / "logs").mkdir()
    (tmp_path / "run.json").write_text(json.dumps({"modes": {}}))
    for bad, why in (("missing.json", "missing.json"), ("run.json", "holds no start")):
        done = log_timeline(str(tmp_path / bad))
        assert done.returncode == 2 and len(done.stderr.strip().splitlines()) == 1 and why in done.stderr, done.stderr


def test_the_stage_ranges_span_each_value_over_a_modes_starts(coldstart, tmp_path):
    """scripts/coldstart_stage_ranges.py on a fresh run: each stage's length and each detail's number as the
    range over the mode's starts, from the JSON; a mode the run lacks, or no run, is one line and exit 2."""
    out, _ = coldstart
    run = out / "coldstart.json"
    done = subprocess.run([sys.executable, "scripts/coldstart_stage_ranges.py", str(run), "--modes", "cold"],
                          cwd=REPO, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    (start,) = json.loads(run.read_text())["modes"]["cold"]["runs"]
    lines = done.stdout.splitlines()
    assert lines[0] == f"cold: 1 starts, spawn to first token {start['spawn_to_first_token_s']:.3f} s"
    for stage in start["stages"]:
        (line,) = [line for line in lines if line.startswith(f"  {stage['stage']}: ")]
        assert f"seconds {stage['seconds']:.3f}" in line
    for bad, why in ((["--modes", "nothing"], "no mode nothing"), ([], "not a faas-bench coldstart JSON")):
        path = str(run) if bad else str(tmp_path / "missing.json")
        done = subprocess.run([sys.executable, "scripts/coldstart_stage_ranges.py", path, *bad], cwd=REPO,
                              capture_output=True, text=True, timeout=60)
        assert done.returncode == 2 and len(done.stderr.strip().splitlines()) == 1 and why in done.stderr


def test_a_warm_run_warms_the_directory_transformers_loads_and_the_libraries_every_start_imports(tiny_model,
                                                                                                  tmp_path):
    """The transformers baseline's own directory (--baseline-model) and the libraries the starts import from are
    read into the page cache before a warm run, as the model and the snapshots are: no mode's first start may be
    the one that reads them from disk. The library file here is one `import torch` does not read."""
    import transformers.models.llama.modeling_llama as modeling

    from runtime.bench.coldstart import ColdStartPlan, _warm_up
    from runtime.weights.residency import cached_fraction
    from tests.test_weights_prefetch import STILL_CACHED, drop_from_page_cache

    source = Path(tiny_model("tiny-llama"))
    files = [str(p) for p in source.iterdir() if p.is_file()]
    library = [path for path in (modeling.__file__, modeling.__cached__) if path and Path(path).exists()]
    drop_from_page_cache(files + library)
    plan = ColdStartPlan(model=str(tmp_path / "layout"), modes=("transformers",), repeat=1, page_cache="warm",
                         settings={}, log_dir=tmp_path, baseline_model=str(source))
    _warm_up(plan)
    assert cached_fraction(files) >= STILL_CACHED
    assert cached_fraction(library) >= STILL_CACHED


def test_the_warm_up_reads_no_directory_that_holds_the_checkout(tmp_path):
    """A PYTHONPATH entry above the checkout (/, its parent) would make the warm-up read everything under it: the
    checkout and what holds it are left out, the interpreter's own libraries are not."""
    import os

    from runtime.bench.coldstart import _import_roots
    from runtime.bench.instance import SOURCE_ROOT, child_environment

    env = child_environment({}, 0.0)
    env["PYTHONPATH"] = os.pathsep.join([env["PYTHONPATH"], "/", str(SOURCE_ROOT.parent), str(tmp_path)])
    roots = _import_roots(env)
    assert tmp_path.resolve() in roots and Path(pytest.__file__).resolve().parents[1] in roots
    assert not any(SOURCE_ROOT.is_relative_to(root) for root in roots)


def test_the_memory_first_touch_probe_times_each_pass_and_refuses_bad_input(tmp_path):
    """scripts/probe_memory_first_touch.py: each pass writes the memory it maps, after its idle wait, and the JSON
    says how long each took and whether the machine's balloon reports free pages to its host."""
    out = tmp_path / "first-touch.json"
    probe = [sys.executable, "scripts/probe_memory_first_touch.py"]
    done = subprocess.run([*probe, "--gib", "0.0625", "--idle", "0,0.2", "--out", str(out)], cwd=REPO,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    record = json.loads(out.read_text())
    assert record["bytes"] == 64 << 20 and record["free_page_reporting"] in (True, False, None)
    assert [p["idle_before_s"] for p in record["passes"]] == [0.0, 0.2]
    for written in record["passes"]:
        assert written["seconds"] > 0 and written["gib_s"] == pytest.approx(1 / 16 / written["seconds"], rel=0.01)
    assert done.stdout.count("GiB written in") == 2
    for argv, says in ((["--gib", "0"], "less than a page"), (["--idle", "1,x"], "not a list of seconds")):
        bad = subprocess.run([*probe, *argv], cwd=REPO, capture_output=True, text=True, timeout=60)
        assert bad.returncode == 2 and says in bad.stderr


def test_reference_read_threads_counts_which_thread_count_read_faster_round_by_round(tmp_path):
    """scripts/reference_read_threads.py: rounds paired across the two counts, an older run's single reads as one
    round, a run without both counts named and left out, bad input one line and exit 2."""
    runs = {
        "rounds.json": {"disk_read": {"reads_by_threads": {"8": [9.0, 8.0, 9.5], "16": [8.5, 8.2, 9.0]}}},
        "once.json": {"disk_read": {"seconds_by_threads": {"8": 8.0, "16": 8.4}}},
        "eight-only.json": {"disk_read": {"seconds_by_threads": {"8": 8.0}}},
    }
    for name, report in runs.items():
        (tmp_path / name).write_text(json.dumps(report))
    script = [sys.executable, "scripts/reference_read_threads.py"]
    done = subprocess.run([*script, *(str(tmp_path / name) for name in runs)], cwd=REPO, capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == ["rounds.json: 16 threads faster in 2 of 3",
                                        "once.json: 16 threads faster in 0 of 1",
                                        "eight-only.json: no reads by both 8 and 16 threads",
                                        "16 threads faster in 2 of 4 pairs, 8 threads in 2"]
    (tmp_path / "bad.json").write_text("{not json")
    bad = subprocess.run([*script, str(tmp_path / "bad.json")], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and len(bad.stderr.strip().splitlines()) == 1 and "bad.json" in bad.stderr
