"""What a result was measured on, recorded beside it: date, host, CPU, GPU, versions."""

from __future__ import annotations

import datetime
import os
import platform
import shutil
import subprocess
import sys
from typing import Any


def describe_machine() -> dict[str, Any]:
    return {"date_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "host": platform.node(), "platform": platform.platform(), "python": sys.version.split()[0],
            "cpus": os.cpu_count(), "gpus": _gpu_names()}


def _gpu_names() -> list[str]:
    # nvidia-smi rather than torch: the bench itself never initialises CUDA (it would hold GPU memory)
    if shutil.which("nvidia-smi") is None:
        return []
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=20, check=True).stdout
    except (OSError, subprocess.SubprocessError):
        return []
    return [line.strip() for line in out.splitlines() if line.strip()]
