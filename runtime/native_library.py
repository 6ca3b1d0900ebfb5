"""The project's optional C libraries (built by `pip install` from pyproject's ext-modules, loaded with ctypes,
which releases the GIL for the length of a call): found and opened in one place, a failure said in the log
with what the caller does instead."""

from __future__ import annotations

import ctypes
import importlib.util
import logging


def open_built(module: str, what: str, instead: str, log: logging.Logger) -> ctypes.CDLL | None:
    """The library built as MODULE, or None when it was not built or does not load (logged on LOG as
    "WHAT ...: INSTEAD")."""
    spec = importlib.util.find_spec(module)
    if spec is None or spec.origin is None:
        log.warning("%s was not built (no C compiler at install?): %s", what, instead)
        return None
    try:
        return ctypes.CDLL(spec.origin)
    except OSError as exc:
        log.warning("%s does not load (%s): %s", what, exc, instead)
        return None
