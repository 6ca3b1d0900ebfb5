"""The S3 tier against a real S3-compatible server on loopback (moto's server mode), reached through a
loopback proxy that counts requests and can cut a response short: build to S3, load from S3, the second
load from the disk cache, a cut part retried, a corrupted or missing object named, the cache's bound."""

import os
from pathlib import Path

import boto3
import pytest
from moto.server import ThreadedMotoServer

from runtime.weights.errors import WeightsError
from runtime.weights.layout import write_layout
from runtime.weights.manifest import Manifest
from tests.weights_helpers import CuttingProxy, cpu_settings, greedy, start

BUCKET = "models"
SMALL = dict(file_bytes=200_000, chunk_bytes=48 * 1024, progress=False)
AWS = {"AWS_ACCESS_KEY_ID": "test", "AWS_SECRET_ACCESS_KEY": "test", "AWS_DEFAULT_REGION": "us-east-1",
       "S3_PART_MB": "0.05"}  # 50 KiB parts: every file is several ranged GETs and multipart parts


@pytest.fixture(scope="module")
def moto_url():
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    saved = {k: os.environ.get(k) for k in [*AWS, "AWS_ENDPOINT_URL"]}
    os.environ.update(AWS, AWS_ENDPOINT_URL=f"http://{host}:{port}")
    boto3.client("s3").create_bucket(Bucket=BUCKET)
    yield (host, port)
    for k, v in saved.items():
        os.environ.pop(k, None) if v is None else os.environ.__setitem__(k, v)
    server.stop()


@pytest.fixture
def proxy(moto_url, monkeypatch):
    """Loads go through the proxy; builds and test set-up talk to moto directly."""
    proxy = CuttingProxy(moto_url)
    yield proxy
    proxy.stop()


def through(proxy, monkeypatch):
    monkeypatch.setenv("AWS_ENDPOINT_URL", proxy.url)


@pytest.fixture(scope="module")
def s3_layout(moto_url, tiny_model):
    url = f"s3://{BUCKET}/layouts/tiny-llama"
    write_layout(tiny_model("tiny-llama"), url, dtype="float32", **SMALL)
    return url


@pytest.fixture(scope="module")
def expected_text(tiny_model, tmp_path_factory):
    return greedy(start(tiny_model("tiny-llama"), cpu_settings(tmp_path_factory.mktemp("c"))))


def test_load_from_s3_then_from_the_disk_cache_with_the_same_text(s3_layout, expected_text, proxy, monkeypatch,
                                                                  tmp_path):
    through(proxy, monkeypatch)
    settings = cpu_settings(tmp_path / "cache")
    engine = start(s3_layout, settings)
    manifest = Manifest.read(engine.model_dir)
    assert engine.timeline.get("weights").detail["tiers"] == {"s3": pytest.approx(
        {"bytes": manifest.total_bytes, "seconds": 0, "gib_s": 0}, abs=1e9)}
    assert greedy(engine) == expected_text
    cold_gets = proxy.ranged_gets("weights-")
    assert cold_gets >= len(manifest.files) * 2  # several parts per file
    assert sorted(p.name for p in engine.model_dir.glob("weights-*")) == [f.name for f in manifest.files]

    engine = start(s3_layout, settings)
    assert proxy.ranged_gets("weights-") == cold_gets  # no weight byte from S3 the second time
    assert set(engine.timeline.get("weights").detail["tiers"]) == {"disk"}
    assert greedy(engine) == expected_text


def test_a_part_cut_short_is_retried(s3_layout, expected_text, proxy, monkeypatch, tmp_path):
    through(proxy, monkeypatch)
    proxy.cut_next("weights-00001.bin")
    engine = start(s3_layout, cpu_settings(tmp_path))
    assert len(proxy.cut_done) == 1  # the failure really happened...
    assert greedy(engine) == expected_text  # ...and the load still got every byte right


def test_build_from_an_s3_hf_dir_equals_the_local_build(moto_url, tiny_model, tmp_path):
    s3 = boto3.client("s3")
    src = Path(tiny_model("tiny-qwen2"))
    for p in src.iterdir():
        s3.upload_file(str(p), BUCKET, f"hf/tiny-qwen2/{p.name}")
    from_s3 = write_layout(f"s3://{BUCKET}/hf/tiny-qwen2", str(tmp_path / "a"), dtype="float32", **SMALL)
    local = write_layout(str(src), str(tmp_path / "b"), dtype="float32", **SMALL)
    assert from_s3 == local
    engine = start(f"s3://{BUCKET}/hf/tiny-qwen2", cpu_settings(tmp_path / "cache"))  # MODEL=s3:// HF dir
    assert greedy(engine) == greedy(start(str(src), cpu_settings(tmp_path / "cache")))


def copy_prefix(src: str, dst: str) -> None:
    s3 = boto3.client("s3")
    for o in s3.list_objects_v2(Bucket=BUCKET, Prefix=src + "/")["Contents"]:
        body = s3.get_object(Bucket=BUCKET, Key=o["Key"])["Body"].read()
        s3.put_object(Bucket=BUCKET, Key=dst + o["Key"][len(src):], Body=body)


def test_a_corrupted_object_is_an_error_naming_it_and_is_not_cached(s3_layout, proxy, monkeypatch, tmp_path):
    copy_prefix("layouts/tiny-llama", "layouts/corrupt")
    s3 = boto3.client("s3")
    key = "layouts/corrupt/weights-00001.bin"
    data = bytearray(s3.get_object(Bucket=BUCKET, Key=key)["Body"].read())
    data[100] ^= 0xFF
    s3.put_object(Bucket=BUCKET, Key=key, Body=bytes(data))
    through(proxy, monkeypatch)
    with pytest.raises(WeightsError, match=r"weights-00001\.bin chunk 0 .* fails its xxh3-128 check"):
        start(f"s3://{BUCKET}/layouts/corrupt", cpu_settings(tmp_path))
    cached = {p.name for p in (tmp_path / "weights").glob("*/weights-*")}
    assert "weights-00001.bin" not in cached and not list((tmp_path / "weights").glob("*/.part-*"))


def test_a_damaged_cache_copy_is_fetched_again_once_and_the_start_goes_on(s3_layout, expected_text, proxy,
                                                                          monkeypatch, tmp_path, caplog):
    """The S3 objects are intact, the disk cache's copies are not (a weight file, the config): each copy that
    fails its check is discarded and fetched again from S3, and the start serves the right text."""
    through(proxy, monkeypatch)
    settings = cpu_settings(tmp_path / "cache")
    entry = start(s3_layout, settings).model_dir
    gets = proxy.ranged_gets("weights-")
    victim = entry / "weights-00001.bin"
    data = bytearray(victim.read_bytes())
    data[len(data) // 2] ^= 0x01
    victim.write_bytes(bytes(data))  # same size, one bit
    config = entry / "config.json"
    config.write_text(config.read_text().replace('"rope_theta": 10000.0', '"rope_theta": 500000.0'))
    with caplog.at_level("WARNING", logger="thawllm"):
        engine = start(s3_layout, settings)
    assert greedy(engine) == expected_text
    assert proxy.ranged_gets("weights-") > gets  # the damaged file came from S3 again
    warned = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert any("weights-00001.bin failed its check" in m and "streamed again from S3" in m for m in warned)
    assert any("config.json fails its digest" in m and "fetched again" in m for m in warned)
    assert victim.read_bytes() != bytes(data)  # the cache holds the good copy now: the next start reads it
    gets = proxy.ranged_gets("weights-")
    assert greedy(start(s3_layout, settings)) == expected_text and proxy.ranged_gets("weights-") == gets


def test_a_missing_object_is_an_error_naming_it(s3_layout, proxy, monkeypatch, tmp_path):
    copy_prefix("layouts/tiny-llama", "layouts/missing")
    boto3.client("s3").delete_object(Bucket=BUCKET, Key="layouts/missing/weights-00000.bin")
    through(proxy, monkeypatch)
    with pytest.raises(WeightsError, match=r"s3://models/layouts/missing/weights-00000\.bin: no such object"):
        start(f"s3://{BUCKET}/layouts/missing", cpu_settings(tmp_path))
    with pytest.raises(WeightsError, match="nothing-here: no objects there"):
        start(f"s3://{BUCKET}/layouts/nothing-here", cpu_settings(tmp_path))


def test_the_disk_cache_evicts_the_least_recently_used_within_its_bound(moto_url, s3_layout, tiny_model, tmp_path):
    other = f"s3://{BUCKET}/layouts/tiny-qwen2"
    write_layout(tiny_model("tiny-qwen2"), other, dtype="float32", **SMALL)
    probe = start(s3_layout, cpu_settings(tmp_path / "probe"))
    probe.shutdown()
    size = Manifest.read(probe.model_dir).total_bytes
    bound_gb = 1.5 * size / 2**30  # room for one layout and a half
    settings = cpu_settings(tmp_path / "c", CACHE_MAX_GB=str(bound_gb))
    engines = [start(s3_layout, settings), start(other, settings)]
    for engine in engines:
        engine.shutdown()
    llama, qwen = (engine.model_dir for engine in engines)
    cached = lambda d: [p for p in d.glob("weights-*")]  # noqa: E731
    total = sum(p.stat().st_size for p in (tmp_path / "c" / "weights").glob("*/*"))
    assert total <= bound_gb * 2**30
    assert len(cached(qwen)) == len(Manifest.read(qwen).files)  # the one in use is whole
    assert len(cached(llama)) < len(Manifest.read(llama).files)  # the older one gave way
    start(s3_layout, settings).shutdown()  # and is streamed again, evicting in turn
    assert len(cached(llama)) == len(Manifest.read(llama).files)


def test_build_to_s3_refuses_an_existing_layout_and_a_failed_build_uploads_nothing(moto_url, s3_layout, tiny_model,
                                                                                   tmp_path):
    with pytest.raises(WeightsError, match="already holds a layout"):
        write_layout(tiny_model("tiny-llama"), s3_layout, dtype="float32", **SMALL)
    with pytest.raises(WeightsError):
        write_layout(str(tmp_path / "absent"), f"s3://{BUCKET}/layouts/failed", dtype="float32", **SMALL)
    assert "Contents" not in boto3.client("s3").list_objects_v2(Bucket=BUCKET, Prefix="layouts/failed/")


def test_build_to_s3_keeps_one_weight_file_on_local_disk_and_a_build_failing_midway_leaves_no_object(
        moto_url, tiny_model, tmp_path, monkeypatch):
    import tempfile
    import threading

    from safetensors.torch import load_file, save_file

    scratch = tmp_path / "scratch"
    scratch.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(scratch))
    most, done = [0], threading.Event()

    def watch():  # how many weight files the build holds on local disk at once
        while not done.is_set():
            try:
                most[0] = max(most[0], len(list(scratch.rglob("weights-*.bin"))))
            except OSError:  # a directory went away while it was listed
                pass

    watcher = threading.Thread(target=watch)
    watcher.start()
    try:
        manifest = write_layout(tiny_model("tiny-llama"), f"s3://{BUCKET}/layouts/streamed", dtype="float32",
                                **{**SMALL, "file_bytes": 50_000})
    finally:
        done.set()
        watcher.join()
    assert len(manifest.files) >= 3 and most[0] == 1
    assert Manifest.from_json(boto3.client("s3").get_object(
        Bucket=BUCKET, Key="layouts/streamed/manifest.json")["Body"].read()) == manifest

    broken = tmp_path / "broken"  # the last tensor is missing: the build fails after uploading earlier files
    broken.mkdir()
    for f in Path(tiny_model("tiny-llama")).iterdir():
        if f.suffix == ".safetensors":
            tensors = load_file(f)
            tensors.pop("model.norm.weight", None)
            save_file(tensors, broken / f.name)
        else:
            (broken / f.name).write_bytes(f.read_bytes())
    with pytest.raises(WeightsError, match="model.norm.weight is missing"):
        write_layout(str(broken), f"s3://{BUCKET}/layouts/half", dtype="float32", **{**SMALL, "file_bytes": 50_000})
    assert "Contents" not in boto3.client("s3").list_objects_v2(Bucket=BUCKET, Prefix="layouts/half/")
    assert list(scratch.glob("faas-build-*")) == []



def test_one_bounded_retry_policy_with_backoff(s3_layout, proxy, monkeypatch):
    """A store that keeps answering 503 gets exactly `attempts` requests per call (not botocore's retries
    inside ours), then a one-line error; one that recovers is retried until it does."""
    from runtime.weights.s3 import S3Options, S3Store, split_url

    through(proxy, monkeypatch)
    store = S3Store(S3Options(attempts=3, backoff_s=0.01))
    bucket, prefix = split_url(s3_layout)
    proxy.fail("GET", "/manifest.json", 100)
    with pytest.raises(WeightsError, match="manifest.json: .*503"):
        store.get_bytes(bucket, f"{prefix}/manifest.json")
    assert proxy.count("GET", "/manifest.json") == 3
    proxy.failing.clear()
    proxy.fail("GET", "/manifest.json", 2)
    assert store.get_bytes(bucket, f"{prefix}/manifest.json").startswith(b"{")
    assert proxy.count("GET", "/manifest.json") == 6


def test_delete_is_retried(moto_url, proxy, monkeypatch):
    from runtime.weights.s3 import S3Options, S3Store

    direct = boto3.client("s3")
    keys = [f"to-delete/{i}" for i in range(3)]
    for key in keys:
        direct.put_object(Bucket=BUCKET, Key=key, Body=b"x")
    through(proxy, monkeypatch)
    store = S3Store(S3Options(attempts=3, backoff_s=0.01))
    proxy.fail("POST", "delete", 2)
    store.delete(BUCKET, keys)
    assert proxy.count("POST", "delete") == 3
    assert "Contents" not in direct.list_objects_v2(Bucket=BUCKET, Prefix="to-delete/")
