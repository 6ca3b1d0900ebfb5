"""The real faas-bootstrap serving a faas-build layout from S3 (moto on loopback): same greedy text as the
server on the plain Hugging Face directory, first from S3, then from the disk cache."""

import boto3
import openai
from moto.server import ThreadedMotoServer

from runtime.weights.layout import write_layout
from tests.server.conftest import API_KEY, start_server


def greedy_text(url: str, model: str) -> str:
    client = openai.OpenAI(base_url=f"{url}/v1", api_key=API_KEY, max_retries=0, timeout=60)
    done = client.completions.create(model=model, prompt="The quick brown fox", max_tokens=16, temperature=0)
    return done.choices[0].text


def test_an_s3_layout_serves_the_same_text_from_s3_then_from_the_disk_cache(server, tiny_model_dir, tmp_path,
                                                                          monkeypatch):
    moto = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    moto.start()
    host, port = moto.get_host_and_port()
    aws = {"AWS_ENDPOINT_URL": f"http://{host}:{port}", "AWS_ACCESS_KEY_ID": "x", "AWS_SECRET_ACCESS_KEY": "x",
           "AWS_DEFAULT_REGION": "us-east-1"}
    for k, v in aws.items():
        monkeypatch.setenv(k, v)
    try:
        boto3.client("s3").create_bucket(Bucket="models")
        write_layout(str(tiny_model_dir), "s3://models/tiny", dtype="float32", progress=False)
        expected = greedy_text(server.url, "tiny-llama")
        for run in ("s3", "disk"):
            srv = start_server(tmp_path, run, MODEL="s3://models/tiny", SERVED_MODEL_NAME="tiny-llama",
                               API_KEY=API_KEY, CACHE_DIR=str(tmp_path / "cache"), MAX_NUM_SEQS="4", **aws)
            try:
                srv.wait_ready()
                assert greedy_text(srv.url, "tiny-llama") == expected
            finally:
                srv.stop()
            assert f"{run}=" in srv.log().split("weights: ", 1)[1].splitlines()[0]  # the tier it came from
    finally:
        moto.stop()
