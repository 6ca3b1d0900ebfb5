"""What checking a CRIU snapshot's files against their baked digests adds to a restore.

The check (snapshots/integrity.py) hashes the image files on threads while CRIU restores, and the hand-over
waits for its verdict; what it adds to the start is the part of it that outlasts the restore (CRIU's, and on
a gpu snapshot the CUDA restore after it). This script (1) times the check alone, several rounds with the
files in the page cache, and (2) boots faas-bootstrap from the snapshot N times and reads each boot's
`restore` and `snapshot_verify` stages from /health: `added_s` is how long the hand-over waited for the
verdict after CRIU (and CUDA) were done. Without --snapshot-dir it first bakes a process snapshot of the
embedded SmolLM2 on the CPU. Settings for the boots come from the environment (MODEL, DEVICE, ...).

    python scripts/bench_snapshot_verify.py --out verify-cpu.json                     # embedded, CPU
    MODEL=/models/qwen2-layout python scripts/bench_snapshot_verify.py --snapshot-dir /snapshots --kind gpu
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from runtime.bench.instance import entry_command  # noqa: E402

EMBEDDED_ENV = {"DEVICE": "cpu", "MAX_MODEL_LEN": "512", "MAX_NUM_SEQS": "4"}


def bake_embedded(snapshot_dir: Path, cache: Path) -> None:
    from runtime.config import Settings
    from runtime.weights.embedded import embedded_model_dir
    from snapshots.process import bake_process_snapshot

    os.environ.update(EMBEDDED_ENV, CACHE_DIR=str(cache))
    settings = Settings.from_env()
    bake_process_snapshot(settings, embedded_model_dir(cache), snapshot_dir)


def hash_rounds(directory: Path, rounds: int) -> tuple[int, list[float]]:
    from snapshots.image import SnapshotImage

    image = SnapshotImage.read(directory)
    seconds = []
    for _ in range(rounds):
        check = image.start_verify(directory)
        check.wait()
        seconds.append(check.ended - check.started)
    return image.size_bytes, seconds


def boot(snapshot_dir: Path, env: dict[str, str], timeout: float = 300.0, stderr=None) -> dict:
    """Start faas-bootstrap from SNAPSHOT_DIR, return its /health once ready (STDERR: a file to keep its log)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    paths = [str(REPO), *filter(None, [os.environ.get("PYTHONPATH")])]  # keep where the packages are
    env = os.environ | env | {"SNAPSHOT_DIR": str(snapshot_dir), "PORT": str(port), "HOST": "127.0.0.1",
                              "PYTHONPATH": os.pathsep.join(paths)}
    log = stderr or tempfile.TemporaryFile(mode="w+")
    process = subprocess.Popen(entry_command(), cwd=REPO, env=env,
                               stdout=subprocess.DEVNULL, stderr=log)
    try:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                r = httpx.get(f"http://127.0.0.1:{port}/health", timeout=2)
                if r.status_code == 200:
                    return r.json()
            except httpx.TransportError:
                pass
            if process.poll() is not None:
                log.seek(0)
                tail = "\n".join(log.read().strip().splitlines()[-15:])
                raise RuntimeError(f"faas-bootstrap exited {process.returncode}:\n{tail}")
            time.sleep(0.05)
        raise TimeoutError("not ready")
    finally:
        process.terminate()
        process.wait(60)
        if stderr is None:
            log.close()


def added_by_check(health: dict, kind: str) -> dict:
    stages = {s["stage"]: s for s in health["stages"] if s["stage"] != "snapshot_verify"}
    # the image's check: a process restore also checks its materialised state, later, under the same name
    checks = [s for s in health["stages"] if s["stage"] == "snapshot_verify" and s["detail"]["snapshot"] == kind]
    if health["restore_path"] != kind or not checks:
        raise RuntimeError(f"restored {health['restore_path']!r}, not {kind}: {health['skipped']}")
    restore, verify = stages["restore"], checks[0]
    detail = restore.get("detail", {})
    restored_at = restore["start_s"] + detail.get("criu_s", 0.0) + detail.get("cuda_s", 0.0)
    return {"restore_s": restore["seconds"], "criu_s": detail.get("criu_s"), "cuda_s": detail.get("cuda_s"),
            "verify_s": verify["seconds"], "verify_bytes": verify["detail"]["bytes"],
            "added_s": round(max(0.0, verify["end_s"] - restored_at), 4)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--snapshot-dir", type=Path, help="holds <kind>/ (default: bake the embedded model's)")
    p.add_argument("--kind", default="process", choices=("process", "gpu"))
    p.add_argument("--rounds", type=int, default=5, help="rounds of the check alone")
    p.add_argument("--boots", type=int, default=3)
    p.add_argument("--out", type=Path)
    a = p.parse_args()
    work = Path(tempfile.mkdtemp(prefix="bench-verify-"))
    env: dict[str, str] = {}
    if a.snapshot_dir is None:
        a.snapshot_dir = work / "snapshots"
        bake_embedded(a.snapshot_dir, work / "cache")
        env = EMBEDDED_ENV | {"CACHE_DIR": str(work / "cache")}
    size, rounds = hash_rounds(a.snapshot_dir / a.kind, a.rounds)
    env["RESTORE"] = a.kind  # not the order faas-build measured: the kind asked for
    boots = [added_by_check(boot(a.snapshot_dir, env), a.kind) for _ in range(a.boots)]
    result = {"kind": a.kind, "image_bytes": size, "cpus": os.cpu_count(), "check_alone_s": rounds,
              "check_alone_gib_s": round(size / statistics.median(rounds) / 2**30, 2), "boots": boots,
              "added_s_median": statistics.median(b["added_s"] for b in boots)}
    print(json.dumps(result, indent=1))
    if a.out:
        a.out.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
