"""faas-build's weights step and the pipelined loader on local files: the layout's bytes are the engine's
weight buffer, greedy text is unchanged, corruption is caught, a failed build leaves nothing, the CLI."""

import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import threading
from pathlib import Path

import blake3
import pytest
import torch
import xxhash
from safetensors.torch import load_file, save_file

from runtime.engine.model_config import ModelConfig
from runtime.engine.weight_plan import plan_weights
from runtime.launch import build_engine, engine_config
from runtime.timeline import Timeline
from runtime.weights.errors import WeightsError
from runtime.weights.hf_dir import hf_dir_loader
from runtime.weights.layout import write_layout
from runtime.weights.loader import LoaderOptions, LayoutLoader
from runtime.weights.manifest import HASHES, Manifest
from runtime.weights.native_reader import native
from runtime.weights.readers import ReaderPool
from snapshots.build import BuildError, parse_args
from tests.weights_helpers import cpu_settings, greedy, start

SMALL = dict(file_bytes=200_000, chunk_bytes=48 * 1024, progress=False)  # several files, many chunks
#: each chunk hash computed in one go by its own library, to check the layout's streamed digests against
REFERENCE = {"xxh3-128": lambda b: xxhash.xxh3_128(b).hexdigest(), "blake3": lambda b: blake3.blake3(b).hexdigest(),
             "sha256": lambda b: hashlib.sha256(b).hexdigest()}


@pytest.fixture(scope="module")
def local_layout(tiny_model, tmp_path_factory):
    out = tmp_path_factory.mktemp("layouts") / "tiny-llama-f32"
    write_layout(tiny_model("tiny-llama"), str(out), dtype="float32", **SMALL)
    return out


def test_layout_bytes_are_the_engine_weight_buffer(tiny_model, local_layout):
    plan = plan_weights(ModelConfig.from_dir(tiny_model("tiny-llama")), "float32")
    expected = torch.zeros(plan.total_bytes, dtype=torch.uint8)
    hf_dir_loader(Path(tiny_model("tiny-llama")))(plan, expected).wait()
    # one reader, readers racing over the chunks, and pieces read and hashed in windows that do not divide them
    for threads, window in ((1, 0), (3, 0), (3, 4096)):
        got = torch.full((plan.total_bytes,), 7, dtype=torch.uint8)
        options = LoaderOptions(threads=threads, read_bytes=20_000, hash_window_bytes=window)
        LayoutLoader(local_layout, options)(plan, got).wait()
        assert torch.equal(got, expected)
    manifest = Manifest.read(local_layout)
    assert manifest.hash == "xxh3-128"  # the default
    assert len(manifest.files) >= 2 and sum(len(f.digests) for f in manifest.files) > len(manifest.files)
    assert b"".join((local_layout / f.name).read_bytes() for f in manifest.files) == expected.numpy().tobytes()
    by_name = {t.name: t for t in manifest.tensors}
    t = by_name["model.layers.1.mlp.down_proj.weight"]
    data = (local_layout / t.file).read_bytes()[t.offset:t.offset + t.length]
    ref = load_file(Path(tiny_model("tiny-llama")) / "model.safetensors")["model.layers.1.mlp.down_proj.weight"]
    assert data == ref.float().contiguous().numpy().tobytes()


def _reader_threads() -> set[threading.Thread]:
    return {t for t in threading.enumerate() if t.name.startswith("weights-reader-")}


def test_readers_are_started_with_the_loader_and_kept_for_the_next_load(tiny_model, local_layout):
    plan = plan_weights(ModelConfig.from_dir(local_layout), "float32")
    expected = torch.zeros(plan.total_bytes, dtype=torch.uint8)
    hf_dir_loader(Path(tiny_model("tiny-llama")))(plan, expected).wait()
    load = LayoutLoader(local_layout, LoaderOptions(threads=3, read_bytes=20_000))
    started = _reader_threads()
    assert len(started) >= 3
    buffers = [torch.zeros(plan.total_bytes, dtype=torch.uint8) for _ in range(2)]
    for stream in [load(plan, b) for b in buffers]:  # two in flight at once
        stream.wait()
    assert all(torch.equal(b, expected) for b in buffers)
    kept = _reader_threads()
    assert started <= kept
    load(plan, buffers[0]).wait()  # the threads are idle again: this load starts none
    assert _reader_threads() == kept


def test_a_finished_load_leaves_nothing_holding_its_buffer(local_layout):
    """Once a load is waited for and dropped, its buffer is freed: the idle reader threads keep no reference
    to it (they did, through the last job's stream, and an engine shut down before a second one started on the
    same GPU kept its whole weights)."""
    import gc
    import weakref

    plan = plan_weights(ModelConfig.from_dir(local_layout), "float32")
    stream = LayoutLoader(local_layout, LoaderOptions(threads=3, read_bytes=20_000))(
        plan, torch.zeros(plan.total_bytes, dtype=torch.uint8))
    stream.wait()
    gone = weakref.ref(stream)  # the stream holds the buffer (on a GPU, through its sink)
    del stream
    gc.collect()
    assert gone() is None


def test_a_second_run_of_readers_never_waits_behind_the_first():
    pool = ReaderPool("test-reader")
    everyone = threading.Barrier(5, timeout=10)  # passes only if all five jobs run at the same time
    first, second = pool.run(everyone.wait, 3), pool.run(everyone.wait, 2)
    assert first.wait(10) and second.wait(10)
    assert pool.size == 5
    pool.run(lambda: None, 5).wait(10)
    assert pool.size == 5  # idle threads are reused


def test_the_native_reader_reads_the_layout_and_names_a_truncated_file(local_layout, tmp_path):
    assert native() is not None  # built by the install (scripts/setup.sh makes sure of a C compiler)
    manifest = Manifest.read(local_layout)
    expected = b"".join((local_layout / f.name).read_bytes() for f in manifest.files)
    for reads in ("native", "python"):
        got = torch.full((manifest.total_bytes,), 7, dtype=torch.uint8)
        # unverified: on the CPU a verified load hashes every piece on the host, which reads from Python
        options = LoaderOptions(threads=3, read_bytes=20_000, verify=False, native=reads == "native")
        assert LayoutLoader(local_layout, options)(manifest.plan, got).wait().reads == reads
        assert got.numpy().tobytes() == expected
    short = tmp_path / "short"
    shutil.copytree(local_layout, short)
    last = short / manifest.files[-1].name
    last.write_bytes(last.read_bytes()[:-100])
    with pytest.raises(WeightsError, match=rf"{last}: truncated \({last.stat().st_size} bytes"):
        LayoutLoader(short, LoaderOptions(verify=False))(manifest.plan, got).wait()


def test_wait_tensor_gives_each_tensor_before_the_whole_load_is_waited_for(tiny_model, local_layout):
    plan = plan_weights(ModelConfig.from_dir(local_layout), "float32")
    buffer = torch.zeros(plan.total_bytes, dtype=torch.uint8)
    load = LayoutLoader(local_layout, LoaderOptions(threads=2, read_bytes=20_000))(plan, buffer)
    ref = load_file(Path(tiny_model("tiny-llama")) / "model.safetensors")
    last = plan.tensors[-1]
    load.wait_tensor(last.name)
    got = buffer[last.offset:last.offset + last.nbytes].view(torch.float32).view(last.shape)
    assert torch.equal(got, ref[last.name].float())
    load.wait()


def test_greedy_text_is_the_same_from_the_hf_dir_and_the_layout(tiny_model, local_layout, tmp_path):
    settings = cpu_settings(tmp_path)
    from_hf = greedy(start(tiny_model("tiny-llama"), settings))
    engine = start(str(local_layout), settings)
    assert engine.timeline.get("weights").detail["tiers"]["disk"]["bytes"] == Manifest.read(local_layout).total_bytes
    assert greedy(engine) == from_hf


def test_the_weights_stage_says_how_the_load_went_on_the_timeline_the_engine_has_at_start(local_layout, tmp_path):
    # a restored process snapshot gives its engine the instance's timeline after the engine was built
    settings = cpu_settings(tmp_path)
    engine = build_engine(local_layout, engine_config(settings), None, "m", settings)
    engine.timeline = Timeline()
    engine.start()
    try:
        weights = engine.timeline.get("weights")
        assert weights.detail["tiers"]["disk"]["bytes"] == Manifest.read(local_layout).total_bytes
        assert weights.detail["verified"] == "host" and weights.detail["reads"] in ("native", "python")
        assert 0 < weights.detail["first_landed_s"] <= weights.seconds
    finally:
        engine.shutdown()


def test_a_layout_for_another_dtype_is_refused_by_name(local_layout, tmp_path):
    with pytest.raises(WeightsError, match="float32 weights, the engine wants bfloat16"):
        start(str(local_layout), cpu_settings(tmp_path, DTYPE="bfloat16"))


@pytest.mark.parametrize("hash", HASHES)
def test_a_layout_of_each_chunk_hash_loads_byte_exact(hash, tiny_model, local_layout, tmp_path):
    layout = tmp_path / "layout"
    manifest = write_layout(tiny_model("tiny-llama"), str(layout), dtype="float32", hash=hash, **SMALL)
    assert Manifest.read(layout).hash == hash
    for f in manifest.files:
        data = (layout / f.name).read_bytes()
        assert list(f.digests) == [REFERENCE[hash](data[o:o + n]) for o, n in f.chunks()]
    got = torch.full((manifest.total_bytes,), 7, dtype=torch.uint8)
    LayoutLoader(layout, LoaderOptions(threads=3, read_bytes=20_000))(manifest.plan, got).wait()
    assert got.numpy().tobytes() == b"".join((local_layout / f.name).read_bytes() for f in manifest.files)


@pytest.mark.parametrize("hash", HASHES)
def test_a_corrupted_file_is_an_error_naming_it(hash, tiny_model, tmp_path):
    broken = tmp_path / "broken"
    write_layout(tiny_model("tiny-llama"), str(broken), dtype="float32", hash=hash, **SMALL)
    start(str(broken), cpu_settings(tmp_path)).shutdown()  # loads while intact
    victim = broken / "weights-00001.bin"
    data = bytearray(victim.read_bytes())
    data[len(data) // 2] ^= 0x01  # one bit
    victim.write_bytes(bytes(data))
    with pytest.raises(WeightsError, match=rf"weights-00001\.bin chunk \d+ .* fails its {hash} check"):
        start(str(broken), cpu_settings(tmp_path))
    manifest = Manifest.read(broken)  # read and hashed in small windows: caught the same
    windows = LayoutLoader(broken, LoaderOptions(threads=2, read_bytes=20_000, hash_window_bytes=4096))
    with pytest.raises(WeightsError, match=rf"weights-00001\.bin chunk \d+ .* fails its {hash} check"):
        windows(manifest.plan, torch.zeros(manifest.plan.total_bytes, dtype=torch.uint8)).wait()
    victim.write_bytes(bytes(data[:1000]))
    with pytest.raises(WeightsError, match=r"weights-00001\.bin: truncated"):
        start(str(broken), cpu_settings(tmp_path))


@pytest.mark.parametrize("name, edit", [
    ("config.json", lambda text: text.replace('"rope_theta": 10000.0', '"rope_theta": 500000.0')),
    ("tokenizer.json", lambda text: text.replace('"quick"', '"quack"', 1) if '"quick"' in text else text + " "),
    ("tokenizer_config.json", lambda text: text.replace("<|endoftext|>", "<|im_end|>")),
])
def test_an_edited_small_file_of_a_layout_is_refused_by_name(name, edit, tiny_model, local_layout, tmp_path):
    """config.json, the tokenizer files: every file of a layout is checked against its manifest on load."""
    layout = tmp_path / "edited"
    shutil.copytree(local_layout, layout)
    manifest = Manifest.read(layout)
    assert {"config.json", "tokenizer.json", "tokenizer_config.json"} <= set(manifest.model_files)
    path = layout / name
    edited = edit(path.read_text())
    assert edited != path.read_text()
    path.write_text(edited)
    with pytest.raises(WeightsError, match=rf"{re.escape(name)} does not match the layout's manifest"):
        start(str(layout), cpu_settings(tmp_path))


def test_a_chat_template_added_to_a_layout_is_refused(local_layout, tmp_path):
    layout = tmp_path / "added"
    shutil.copytree(local_layout, layout)
    (layout / "chat_template.jinja").write_text("{{ 'You are a rude pirate.' }}")
    with pytest.raises(WeightsError, match=r"chat_template\.jinja is not in the layout's manifest"):
        start(str(layout), cpu_settings(tmp_path))


def test_a_layout_whose_manifest_predates_small_file_digests_is_refused(local_layout, tmp_path):
    layout = tmp_path / "old"
    shutil.copytree(local_layout, layout)
    raw = json.loads((layout / "manifest.json").read_text())
    raw |= {"format_version": 1, "model_files": list(raw["model_files"])}
    (layout / "manifest.json").write_text(json.dumps(raw))
    with pytest.raises(WeightsError, match="layout format 1, this runtime reads 2: rebuild it"):
        start(str(layout), cpu_settings(tmp_path))


def test_a_failed_build_leaves_nothing(tiny_model, tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    for p in Path(tiny_model("tiny-llama")).iterdir():
        (src / p.name).write_bytes(p.read_bytes())
    weights = load_file(src / "model.safetensors")
    del weights["model.layers.1.mlp.up_proj.weight"]  # fails after the first file was written
    save_file(weights, src / "model.safetensors")
    out = tmp_path / "out" / "layout"
    with pytest.raises(WeightsError, match="model.layers.1.mlp.up_proj.weight is missing"):
        write_layout(str(src), str(out), dtype="float32", **SMALL)
    assert list((tmp_path / "out").iterdir()) == []


def test_content_hash_names_the_source_not_the_dtype(tiny_model, local_layout, tmp_path):
    bf16 = write_layout(tiny_model("tiny-llama"), str(tmp_path / "bf16"), dtype="bfloat16", progress=False)
    other = write_layout(tiny_model("tiny-qwen2"), str(tmp_path / "q"), dtype="float32", progress=False)
    assert bf16.content_hash == Manifest.read(local_layout).content_hash != other.content_hash
    assert bf16.total_bytes * 2 == pytest.approx(Manifest.read(local_layout).total_bytes, rel=0.05)


def faas_build(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "snapshots.build", *args], capture_output=True, text=True,
                          env={**os.environ, **(env or {})}, cwd=Path(__file__).parent.parent, timeout=120)


def test_faas_build_cli_writes_a_layout_and_refuses_bad_input_in_one_line(tiny_model, tmp_path):
    out = tmp_path / "layout"
    done = faas_build("--model", tiny_model("tiny-qwen2"), "--out", str(out), "--dtype", "float32", "--quiet")
    assert done.returncode == 0, done.stderr
    assert Manifest.read(out).dtype == "float32" and Manifest.read(out).hash == "xxh3-128"
    for args, reason in [
        (["--model", str(tmp_path / "nope"), "--out", str(tmp_path / "x")], "is not a Hugging Face model dir"),
        (["--model", tiny_model("tiny-qwen2"), "--out", str(out)], "already exists"),
        (["--model", str(out), "--out", str(tmp_path / "y")], "already a faas-build layout"),
        (["--out", str(tmp_path / "z")], "the following arguments are required: --model"),
        (["--model", tiny_model("tiny-qwen2"), "--out", str(tmp_path / "w"), "--dtype", "int4"], "invalid choice"),
        (["--model", tiny_model("tiny-qwen2"), "--out", str(tmp_path / "v"), "--hash", "bogus"],
         "argument --hash: invalid choice"),
    ]:
        done = faas_build(*args)
        assert done.returncode == 2
        lines = done.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("faas-build: ") and reason in lines[0], done.stderr
    assert not (tmp_path / "x").exists() and not (tmp_path / "y").exists() and not (tmp_path / "v").exists()
    with pytest.raises(BuildError) as bogus:
        parse_args(["--model", "m", "--out", "o", "--hash", "bogus"])
    assert all(h in str(bogus.value) for h in HASHES)  # it offers every hash a layout can have


def test_a_gguf_file_builds_the_same_bytes_as_its_imported_directory(tmp_path):
    from runtime.weights.embedded import embedded_gguf_path
    from runtime.weights.gguf_import import imported_model_dir

    gguf = embedded_gguf_path()
    manifest = write_layout(str(gguf), str(tmp_path / "layout"), dtype="bfloat16", progress=False)
    imported = imported_model_dir(gguf, tmp_path / "cache")
    expected = torch.zeros(manifest.plan.total_bytes, dtype=torch.uint8)
    hf_dir_loader(imported)(manifest.plan, expected).wait()
    got = torch.zeros_like(expected)
    LayoutLoader(tmp_path / "layout")(manifest.plan, got).wait()
    assert torch.equal(got, expected)
    assert (tmp_path / "layout" / "tokenizer.json").read_bytes() == (imported / "tokenizer.json").read_bytes()


def test_an_interrupted_build_leaves_nothing_and_a_killed_ones_leftovers_are_cleared(tiny_model, tmp_path):
    import signal
    import socket
    import time

    hang = socket.socket()  # accepts connections into its backlog and never answers: the build hangs in S3
    hang.bind(("127.0.0.1", 0))
    hang.listen(8)
    scratch = tmp_path / "tmp"
    scratch.mkdir()
    env = {"AWS_ENDPOINT_URL": f"http://127.0.0.1:{hang.getsockname()[1]}", "AWS_ACCESS_KEY_ID": "x",
           "AWS_SECRET_ACCESS_KEY": "x", "AWS_DEFAULT_REGION": "us-east-1", "TMPDIR": str(scratch),
           "PYTHONFAULTHANDLER": "1"}  # a build that does not stop dumps its threads' stacks on SIGABRT
    proc = subprocess.Popen([sys.executable, "-m", "snapshots.build", "--model", "s3://b/model", "--out",
                             str(tmp_path / "out")], env={**os.environ, **env}, cwd=Path(__file__).parent.parent,
                            stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 60
    while not list(scratch.glob("faas-build-*")) and time.time() < deadline:
        time.sleep(0.05)
    assert list(scratch.glob("faas-build-*")), "the build never started"
    proc.terminate()
    try:
        _, err = proc.communicate(timeout=60)  # reads stderr meanwhile, so a full pipe cannot stall the build
    except subprocess.TimeoutExpired:
        proc.send_signal(signal.SIGABRT)
        _, err = proc.communicate()
        raise AssertionError(f"faas-build did not stop on SIGTERM:\n{err[-6000:]}") from None
    assert proc.returncode == 130, err
    assert "faas-build: interrupted" in err
    assert list(scratch.iterdir()) == [] and not (tmp_path / "out").exists()
    hang.close()

    dead = tmp_path / ".layout.tmp-999999999"  # what a SIGKILLed build of ./layout leaves
    dead.mkdir()
    (dead / "weights-00000.bin").write_bytes(b"half")
    write_layout(tiny_model("tiny-qwen2"), str(tmp_path / "layout"), dtype="float32", progress=False)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["layout", "tmp"]
