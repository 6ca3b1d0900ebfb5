"""The models of `faas-bench switch`: random weights of real shapes (scripts/model_shapes.py), each with
its own seed so that no two share a byte, as a Hugging Face directory (what transformers loads) and a
faas-build layout (what the instance serves: its chunks are the groups the pool retains or evicts).

Made once in a models folder and reused. The missing ones are made in one child process (`python -m
runtime.bench.switch_models JOBS_JSON`), so the bench never holds GPU memory itself.
"""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from runtime.bench import BenchError
from runtime.bench.instance import SOURCE_ROOT, child_environment

#: shapes scripts/model_shapes.py knows, spelled out so that parsing the command line imports nothing
SHAPE_NAMES = ("tiny", "smollm2-135m", "qwen2-1.5b", "llama-3-8b")


@dataclass(frozen=True)
class BenchModel:
    name: str  # as clients call it in the instance: "<shape>-<i>"
    shape: str
    seed: int
    hf_dir: Path
    layout_dir: Path
    nbytes: int  # weight bytes of the layout


def parse_shapes(text: str) -> list[tuple[str, int]]:
    """"qwen2-1.5b:4,llama-3-8b:2" -> [(shape, count)]. Raises ValueError."""
    out = []
    for item in text.split(","):
        shape, _, count = item.strip().partition(":")
        if shape not in SHAPE_NAMES:
            raise ValueError(f"unknown shape {shape!r}: choose among {', '.join(SHAPE_NAMES)}")
        n = int(count or 1)
        if n < 1:
            raise ValueError(f"{item!r}: the count must be positive")
        out.append((shape, n))
    return out


def make_models(shapes: list[tuple[str, int]], models_dir: Path, chunk_bytes: int, log_dir: Path) -> list[BenchModel]:
    planned, seed = [], 0
    for shape, count in shapes:
        for i in range(count):
            base = models_dir / f"{shape}-seed{seed}"
            planned.append((f"{shape}-{i}", shape, seed, base, Path(f"{base}-layout")))
            seed += 1
    # transformers loads only the first model of each shape (the probes' B): the others keep their layout alone
    missing = [{"hf_dir": str(base), "layout": str(layout), "shape": shape, "seed": seed, "chunk_bytes": chunk_bytes,
                "keep_weights": name.endswith("-0")}
               for name, shape, seed, base, layout in planned if not _current_layout(layout)]
    if missing:
        _make(missing, log_dir / "make-models.log")
    return [BenchModel(name, shape, seed, base, layout, layout_bytes(layout))
            for name, shape, seed, base, layout in planned]


def _current_layout(layout: Path) -> bool:
    """A layout this runtime reads is there; one of an older format is removed, to be made again."""
    import shutil

    from runtime.weights.manifest import FORMAT_VERSION

    manifest = layout / "manifest.json"
    if not manifest.is_file():
        return False
    if json.loads(manifest.read_text()).get("format_version") == FORMAT_VERSION:
        return True
    shutil.rmtree(layout)
    return False


def layout_bytes(layout: Path) -> int:
    return sum(f["size"] for f in json.loads((layout / "manifest.json").read_text())["files"])


def _make(jobs: list[dict], log_path: Path) -> None:
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "wb") as log:
        done = subprocess.run([sys.executable, "-m", "runtime.bench.switch_models", json.dumps(jobs)],
                              cwd=SOURCE_ROOT, env=child_environment({}, 0.0), stdout=log, stderr=subprocess.STDOUT)
    if done.returncode != 0:
        raise BenchError(f"making the models failed (log: {log_path})")


def _main(jobs: str) -> None:
    from runtime.weights.layout import write_layout
    from scripts.model_shapes import make_random_model_dir

    for job in json.loads(jobs):
        hf_dir = make_random_model_dir(Path(job["hf_dir"]), job["shape"], job["seed"])
        write_layout(job["hf_dir"], job["layout"], dtype="bfloat16", chunk_bytes=job["chunk_bytes"], progress=False)
        if not job["keep_weights"]:  # half the disk for the 8B shapes
            for weights in [*hf_dir.glob("*.safetensors"), *hf_dir.glob("*.safetensors.index.json")]:
                weights.unlink()


if __name__ == "__main__":
    _main(sys.argv[1])
