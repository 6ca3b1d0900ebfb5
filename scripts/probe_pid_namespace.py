"""Does CUDA initialise in a pid namespace of its own? `cuInit` and a device count in a fresh process, run
plainly and under each way `unshare` can make the namespace: as its init or as a later process, with the
host's /proc or a /proc of its own (`--mount-proc`, which is what a container has).

A restored snapshot keeps the pids it was baked with, so two restores of one snapshot on one host clash
unless each runs in a pid namespace of its own: this says which namespaces a CUDA process can live in.

    python scripts/probe_pid_namespace.py --out pid-namespace-h100.json   (as root: unshare needs it)
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

CHILD = r"""
import ctypes, json, os
cu = ctypes.CDLL("libcuda.so.1")
status = cu.cuInit(0)
count = ctypes.c_int(-1)
if status == 0:
    cu.cuDeviceGetCount(ctypes.byref(count))
print(json.dumps({"pid": os.getpid(), "cuInit": status, "devices": count.value}))
"""

#: name -> the command's prefix; "later process" runs Python as a child of a shell that is the init
VARIANTS = {
    "plain": [],
    "namespace init, host /proc": ["unshare", "--pid", "--fork"],
    "namespace init, own /proc": ["unshare", "--pid", "--fork", "--mount-proc"],
    "later process, host /proc": ["unshare", "--pid", "--fork", "sh", "-c", '"$0" "$@"; exit $?'],
    "later process, own /proc": ["unshare", "--pid", "--fork", "--mount-proc", "sh", "-c", '"$0" "$@"; exit $?'],
}


def run_variant(prefix: list[str]) -> dict:
    done = subprocess.run([*prefix, sys.executable, "-c", CHILD], capture_output=True, text=True, timeout=120,
                          check=False)
    lines = done.stdout.strip().splitlines()
    if done.returncode != 0 or not lines:
        return {"ok": False, "exit": done.returncode, "stderr": done.stderr.strip()[-300:]}
    result = json.loads(lines[-1])
    return {"ok": result["cuInit"] == 0 and result["devices"] > 0, **result}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    results = {}
    for name, prefix in VARIANTS.items():
        results[name] = run_variant(prefix)
        print(f"{name:28s} {results[name]}", flush=True)
    args.out.write_text(json.dumps({"variants": results}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
