"""The one logger set-up: every module logs through `logging.getLogger("thawllm.<room>")`."""

from __future__ import annotations

import logging
import sys

_FORMAT = "%(asctime)s.%(msecs)03d %(levelname)s %(name)s: %(message)s"


def setup_logging(level: str = "info") -> None:
    """Route thawllm's logs to the current stderr. Safe to call again after a CRIU restore, which gives the
    process a new stderr."""
    root = logging.getLogger("thawllm")
    for handler in list(root.handlers):
        root.removeHandler(handler)
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter(_FORMAT, datefmt="%H:%M:%S"))
    root.addHandler(handler)
    root.setLevel(level.upper())
    root.propagate = False


def get_logger(room: str) -> logging.Logger:
    return logging.getLogger(f"thawllm.{room}")
