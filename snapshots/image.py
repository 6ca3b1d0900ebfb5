"""A CRIU snapshot on disk (`<SNAPSHOT_DIR>/process/` or `<SNAPSHOT_DIR>/gpu/`): the CRIU image files in
images/ and manifest.json, written last, which says what it is (kind, fingerprint, the handoff socket's id)
and lists every image file with its size (a truncated or missing file is caught before CRIU is run) and its
digest (checked beside the restore, before the hand-over: snapshots/integrity.py)."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

from snapshots.fingerprint import Fingerprint
from snapshots.integrity import Verification
from snapshots.restore_run import IMAGES, MANIFEST, image_file_problem
#: why a several-model instance has no gpu snapshot (its process snapshot holds the engines before CUDA)
SEVERAL_MODELS_NO_GPU = ("a several-model instance has no gpu snapshot: its image would hold started pools, whose "
                         "VMM ranges give their backing back while idle, which the CUDA checkpoint path does not "
                         "handle")


class ImageError(RuntimeError):
    pass


@dataclass
class SnapshotImage:
    kind: str  # "process" or "gpu"
    snapshot_id: str  # names the handoff socket the frozen process listens on
    fingerprint: Fingerprint
    model_dir: str  # the model the frozen engine was built from ("" for several models: model_dirs)
    files: dict[str, int]  # image file -> size in bytes
    baked_at: float
    dump_s: float
    verify_restore_s: float
    timings: dict[str, float] = field(default_factory=dict)
    pid_namespace: bool = True  # restored as the init of a new pid namespace (needs CAP_SYS_ADMIN)
    weights_left_out: bool = False  # gpu: the weights' memory was released before the checkpoint
    hash: str = ""  # of the image files' digests
    digests: dict[str, str] = field(default_factory=dict)  # image file -> digest, taken after the dump
    model_dirs: dict[str, str] = field(default_factory=dict)  # several models: name -> where it was built from
    #: criu's record of the baking machine's kernel features (snapshots/kernel_features.py); {} if not taken
    kernel_features: dict = field(default_factory=dict)

    def sources(self) -> list[str]:
        """The model directories the frozen engines were built from (their weights load from there)."""
        return list(self.model_dirs.values()) or [self.model_dir]

    def engine_device(self) -> str:
        """The device the frozen engine was built for ("cpu", "cuda", ...), from the fingerprint."""
        try:
            return str(json.loads(self.fingerprint.engine_config).get("device", ""))
        except (ValueError, AttributeError):
            return ""

    @property
    def size_bytes(self) -> int:
        return sum(self.files.values())

    def write(self, directory: Path) -> None:
        data = asdict(self) | {"fingerprint": self.fingerprint.as_dict()}
        (directory / MANIFEST).write_text(json.dumps(data, indent=1, sort_keys=True))

    @classmethod
    def read(cls, directory: Path) -> "SnapshotImage":
        try:
            data = json.loads((directory / MANIFEST).read_text())
            data["fingerprint"] = Fingerprint.from_dict(data["fingerprint"])
            return cls(**data)
        except FileNotFoundError:
            raise ImageError(f"no snapshot at {directory}") from None
        except (ValueError, TypeError, KeyError) as exc:
            raise ImageError(f"unreadable {directory / MANIFEST}: {exc}") from None

    def check_files(self, directory: Path) -> None:
        """Every image file there, with the size it was written with (cheap: no reading)."""
        problem = image_file_problem(directory / IMAGES, self.files)
        if problem is not None:
            raise ImageError(problem)
        if set(self.digests) != set(self.files):
            raise ImageError("the snapshot has no digests of its image files (baked by an older faas-build): "
                             "bake it again")

    def start_verify(self, directory: Path) -> Verification:
        """Hash every image file against its baked digest, on threads; `wait()` on the result for the verdict."""
        return Verification.start(directory / IMAGES, self.digests, self.hash, f"{self.kind} snapshot image file")


def list_image_files(directory: Path) -> dict[str, int]:
    return {p.name: p.stat().st_size for p in sorted((directory / IMAGES).iterdir()) if p.is_file()}
