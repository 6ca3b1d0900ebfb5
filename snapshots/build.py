"""faas-build: what a function image is built with, one step after another.

    faas-build --model SRC --out DST [--dtype bfloat16] [--file-gb 2] [--chunk-mb 64] [--hash blake3] [--quiet]

Each step takes the build (arguments and what earlier steps produced) and adds to it; a step that cannot be
done raises BuildError (or WeightsError) and the command prints one line, `faas-build: <reason>`, exit 2.
The steps, in order, are `STEPS`; a new step (snapshots) is a function appended there.
"""

from __future__ import annotations

import argparse
import signal
import sys
from dataclasses import dataclass
from typing import Callable, Sequence

from runtime.logs import get_logger, setup_logging
from runtime.weights.errors import WeightsError

log = get_logger("build")

MiB, GiB = 1 << 20, 1 << 30


class BuildError(Exception):
    pass


@dataclass
class Build:
    model: str  # the source: Hugging Face directory, .gguf file, or s3:// prefix holding either
    out: str  # the layout: a local directory or an s3:// prefix
    dtype: str
    file_bytes: int
    chunk_bytes: int
    hash: str
    progress: bool
    manifest: object | None = None  # runtime.weights.manifest.Manifest, once the weights step has run


def build_weights(build: Build) -> None:
    """The loading-optimised layout of the model's weights at build.out."""
    from runtime.weights.layout import write_layout

    build.manifest = write_layout(build.model, build.out, dtype=build.dtype, file_bytes=build.file_bytes,
                                  chunk_bytes=build.chunk_bytes, hash=build.hash, progress=build.progress)
    log.info("layout written to %s: %.2f GiB in %d files, source %s", build.out,
             build.manifest.total_bytes / GiB, len(build.manifest.files), build.manifest.content_hash)


#: run in order; each one sees what the ones before it produced
STEPS: list[Callable[[Build], None]] = [build_weights]


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # one line, exit 2, like every other bad input
        raise BuildError(message)


def parse_args(argv: Sequence[str]) -> Build:
    p = _Parser(prog="faas-build", description="Build a function image's model layout (and snapshots).")
    p.add_argument("--model", required=True, help="Hugging Face directory, .gguf file, or s3:// prefix")
    p.add_argument("--out", required=True, help="layout destination: a new local directory or an s3:// prefix")
    p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16", "float32"))
    p.add_argument("--file-gb", type=float, default=2.0, help="split the weights into files of about this size")
    p.add_argument("--chunk-mb", type=float, default=64.0, help="hashed chunk size")
    p.add_argument("--hash", default="blake3", choices=("blake3", "sha256"), help="chunk hash")
    p.add_argument("--quiet", action="store_true", help="no progress bars")
    a = p.parse_args(argv)
    if a.file_gb <= 0 or a.chunk_mb <= 0:
        raise BuildError("--file-gb and --chunk-mb must be positive")
    return Build(a.model, a.out, a.dtype, int(a.file_gb * GiB), int(a.chunk_mb * MiB), a.hash, not a.quiet)


def main(argv: Sequence[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    setup_logging("info")
    # SIGTERM unwinds like Ctrl-C, through every step's clean-up, so an interrupted build leaves nothing
    signal.signal(signal.SIGTERM, lambda *_: _interrupt())
    try:
        build = parse_args(argv)
        for step in STEPS:
            step(build)
    except (BuildError, WeightsError) as exc:
        print(f"faas-build: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("faas-build: interrupted; nothing was left at --out", file=sys.stderr)
        return 130
    return 0


def _interrupt() -> None:
    raise KeyboardInterrupt


if __name__ == "__main__":
    sys.exit(main())
