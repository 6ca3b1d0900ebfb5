"""MODEL with several models: the list's syntax, and the one-line exit 2 of a malformed one."""

from __future__ import annotations

import subprocess

import pytest

from runtime.config import ConfigError, ModelRef, Settings
from tests.server.conftest import REPO, bootstrap_command, server_env

HERE = str(REPO)  # a path that exists


def test_a_lone_reference_is_one_unnamed_model_as_before():
    settings = Settings.from_env({"MODEL": "/models/qwen"})
    assert settings.models == (ModelRef(None, "/models/qwen"),) and settings.model == "/models/qwen"
    assert Settings.from_env({}).models == (ModelRef(None, None),)
    # "=" inside a path or an S3 key is not a name
    assert Settings.from_env({"MODEL": "s3://bucket/date=2024/qwen"}).models == (
        ModelRef(None, "s3://bucket/date=2024/qwen"),)


def test_a_lone_named_model_is_served_alone_under_its_name():
    settings = Settings.from_env({"MODEL": "qwen=/models/qwen2"})
    assert settings.model == "/models/qwen2" and settings.served_model_name == "qwen"
    assert len(settings.models) == 1


def test_a_list_names_every_model_in_order():
    settings = Settings.from_args(["--model", "qwen=/models/q, llama = s3://b/l ,smol=embedded"], {})
    assert settings.models == (ModelRef("qwen", "/models/q"), ModelRef("llama", "s3://b/l"),
                               ModelRef("smol", None))
    assert settings.for_model(settings.models[1]).model == "s3://b/l"
    assert settings.for_model(settings.models[1]).served_model_name == "llama"


@pytest.mark.parametrize("model, message", [
    ("a=/x,,b=/y", "entry 2 is empty"),
    ("=/x,b=/y", "model name '' must be"),
    ("a=/x,a=/y", "model name 'a' must appear once"),
    ("a=,b=/y", "model 'a' must have a reference"),
    ("a b=/x,c=/y", "model name 'a b' must be"),
    ("a=/x,/y", "entry '/y' must be name=reference"),
])
def test_a_malformed_list_is_refused(model, message):
    with pytest.raises(ConfigError, match=message):
        Settings.from_env({"MODEL": model})


@pytest.mark.parametrize("env, message", [
    ({"MODEL": "a=/x,,b=/y"}, "MODEL='a=/x,,b=/y': entry 2 is empty"),
    ({"MODEL": f"a={HERE},b={HERE},a={HERE}"}, "model name 'a' must appear once"),
    ({"MODEL": f"a={HERE},b=/no/such/model"}, "MODEL='/no/such/model': no such file or directory"),
    ({"MODEL": f"a={HERE},b={HERE}", "SERVED_MODEL_NAME": "x"}, "SERVED_MODEL_NAME must be unset"),
])
def test_bootstrap_refuses_a_bad_list_with_one_line_and_exit_2(env, message):
    r = subprocess.run(bootstrap_command(), cwd=REPO, env=server_env(**env), capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 2
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("faas-bootstrap: ") and message in lines[0], r.stderr
