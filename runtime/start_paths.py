"""The paths an instance can start by, how a path declines, and the order RESTORE=auto tries them in
(docs/architecture.md, "Restore paths").

The order is the one faas-build measured (`restore-order.json` in SNAPSHOT_DIR: each baked snapshot started
for real, in turns, fastest median first) or, without a valid measurement, the fixed one below. Kept apart
from the server, json only (no dataclasses, pathlib or typing: the entry point reads the order before any of
them is imported, snapshots/early_restore.py), so that a start about to restore a snapshot imports nothing it
will not use.
"""

from __future__ import annotations

import json
import math
import os

TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any

RESTORE_PATHS = ("gpu", "process", "materialized", "cold")
#: the restore paths faster than cold, in the order tried when faas-build measured none
FIXED_ORDER = ("gpu", "process", "materialized")
#: faas-build's measurement, in SNAPSHOT_DIR
ORDER_FILE = "restore-order.json"


class SkipPath(Exception):
    """A restore path cannot be taken on this machine (no snapshot, fingerprint mismatch...): fall back."""


class RestoreOrder:
    """The order auto tries the restore paths in, and what it rests on: PATHS; SECONDS, path -> median seconds
    from spawn to first token as faas-build measured them (empty: fixed order); REASON, why the fixed order
    is used (no measurement, or an invalid one; empty when measured)."""

    __slots__ = ("paths", "seconds", "reason")

    def __init__(self, paths: tuple[str, ...] = FIXED_ORDER, seconds: dict[str, float] | None = None,
                 reason: str = "") -> None:
        self.paths, self.seconds, self.reason = tuple(paths), dict(seconds or {}), reason

    def __eq__(self, other: object) -> bool:
        return isinstance(other, RestoreOrder) and (self.paths, self.seconds, self.reason) == (
            other.paths, other.seconds, other.reason)

    def __repr__(self) -> str:
        return f"RestoreOrder(paths={self.paths!r}, seconds={self.seconds!r}, reason={self.reason!r})"

    @property
    def measured(self) -> bool:
        return bool(self.seconds)

    def report(self) -> dict[str, Any]:
        """For /health: the order, and which path was measured fastest and by how much."""
        out: dict[str, Any] = {"order": list(self.paths), "source": "measured" if self.measured else "fixed"}
        if not self.measured:
            out["reason"] = self.reason
            return out
        ranked = [p for p in self.paths if p in self.seconds]
        out["seconds"] = {p: self.seconds[p] for p in ranked}
        out["fastest"] = ranked[0]
        if len(ranked) > 1:
            out["ahead_of"] = ranked[1]
            out["ahead_by_s"] = round(self.seconds[ranked[1]] - self.seconds[ranked[0]], 4)
        return out

    def summary(self) -> str:
        """One line for the boot log."""
        if not self.measured:
            return f"restore order {', '.join(self.paths)} (fixed: {self.reason})"
        timed = ", ".join(f"{p} {self.seconds[p]:.2f} s" for p in self.paths if p in self.seconds)
        report = self.report()
        ahead = (f"; {report['fastest']} measured fastest by {report['ahead_by_s']:.2f} s"
                 if "ahead_by_s" in report else "")
        return f"restore order {', '.join(self.paths)} (measured by faas-build, spawn to first token: {timed}{ahead})"


def read_restore_order(snapshot_dir: str | os.PathLike | None) -> RestoreOrder:
    """The measured order in SNAPSHOT_DIR, or the fixed one with the reason. Never raises: a damaged file
    must not keep a function from starting. Measured paths come first, fastest first; the others keep their
    fixed order after them."""
    if snapshot_dir is None:
        return RestoreOrder(reason="SNAPSHOT_DIR is not set")
    path = os.path.join(snapshot_dir, ORDER_FILE)
    try:
        with open(path) as f:
            data = json.load(f)
    except FileNotFoundError:
        return RestoreOrder(reason=f"no {ORDER_FILE} in {snapshot_dir}")
    except (OSError, ValueError) as exc:
        return RestoreOrder(reason=f"{path} is unreadable ({type(exc).__name__})")
    seconds = _valid_seconds(data)
    if seconds is None:
        return RestoreOrder(reason=f"{path} is not a valid measurement")
    ranked = sorted(seconds, key=seconds.__getitem__)
    return RestoreOrder(tuple(ranked) + tuple(p for p in FIXED_ORDER if p not in seconds), seconds)


def _valid_seconds(data: Any) -> dict[str, float] | None:
    """path -> median seconds from a `restore-order.json`, or None if it is not one."""
    if not isinstance(data, dict) or not isinstance(data.get("paths"), dict) or not data["paths"]:
        return None
    seconds = {}
    for name, entry in data["paths"].items():
        median = entry.get("median_s") if isinstance(entry, dict) else None
        if name not in FIXED_ORDER or isinstance(median, bool) or not isinstance(median, (int, float)):
            return None
        if not math.isfinite(median) or median <= 0:
            return None
        seconds[name] = float(median)
    return seconds
