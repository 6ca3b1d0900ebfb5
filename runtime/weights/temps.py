"""Temporary names beside a final path, owned by a process: what is written goes there first and is renamed
into place, so a reader never sees half of it. A process killed outright (SIGKILL: no chance to clean up)
leaves its temporary behind; the next writer of the same path recognises it by its dead pid and removes it."""

from __future__ import annotations

import os
import shutil
from pathlib import Path


def temp_beside(final: Path) -> Path:
    return final.with_name(f".{final.name}.tmp-{os.getpid()}")


def write_atomically(path: Path, data: bytes) -> None:
    """PATH holds DATA, written whole or not at all: a reader finds the old file or the new one, never a part."""
    temp = temp_beside(path)
    try:
        temp.write_bytes(data)
        os.replace(temp, path)
    except BaseException:
        temp.unlink(missing_ok=True)
        raise


def remove_dead_temps(final: Path) -> None:
    """Temporaries of `final` whose writer is gone (another live process's are not touched)."""
    for temp in final.parent.glob(f".{final.name}.tmp-*"):
        pid = temp.name.rsplit("-", 1)[-1]
        if pid.isdigit() and not Path(f"/proc/{pid}").exists():
            if temp.is_dir():
                shutil.rmtree(temp, ignore_errors=True)
            else:
                temp.unlink(missing_ok=True)
