"""The paths an instance can start by, fastest first (docs/architecture.md, "Restore paths"), and how a path declines.

Kept apart from the server so that a bootstrap about to restore a snapshot imports nothing it will not use.
"""

from __future__ import annotations

RESTORE_PATHS = ("gpu", "process", "materialized", "cold")


class SkipPath(Exception):
    """A restore path cannot be taken on this machine (no snapshot, fingerprint mismatch...): fall back."""
