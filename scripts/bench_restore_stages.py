"""Where a process-snapshot start spends its time before the restored engine's device phase, and what the
CRIU image is made of.

It bakes a process snapshot (default: the embedded SmolLM2 on the CPU; `--model DIR --device cuda` on a GPU
machine), or takes one from `--snapshot-dir`, then boots `faas-bootstrap` from it `--runs` times
(RESTORE=process) and reads each boot's timeline from /health:

- `spawn_to_restore_s`: spawn to the restore decided (Python's start, the bootstrap's imports, the checks)
- `before_criu_s`: from there to `criu restore` exec'd (a gpu or weights helper started first, if any)
- `criu_s`: criu restore itself
- `handoff_s`: criu done to the restored process having taken over (the digests' verdict waited for, the
  message sent and taken); `verify_after_criu_s`: how much of it was the wait for the digests' verdict
- `bootstrap_s`: the bootstrap's second run in the restored process, up to its restore path (settings,
  logging, app, listening)
- `to_device_phase_s` (CPU, or a GPU context not made ahead): the hand-over to the engine's device phase
- `spawn_to_ready_s`

One more boot runs with `-X importtime` to list the imports before the restore, and `python -c pass` is
timed for the interpreter's own start. The image: its page files' size, and what the frozen runtime's
memory is, per mapping kind (CRIU dumps a mapping's anonymous pages: smaps' `Anonymous`), read from
/proc/PID/smaps of a runtime frozen as the bake freezes it.

    python scripts/bench_restore_stages.py --runs 5 --out restore-stages-cpu.json
    python scripts/bench_restore_stages.py --model /models/qwen2-layout --device cuda --runs 5 --out gpu.json
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench_snapshot_verify import EMBEDDED_ENV, boot  # noqa: E402  (scripts/ is this script's folder)

STAGE_KEYS = ("spawn_to_restore_s", "before_criu_s", "criu_s", "handoff_s", "verify_after_criu_s", "bootstrap_s",
              "to_device_phase_s", "spawn_to_ready_s")


def settings_env(model: str | None, device: str, cache: Path) -> dict[str, str]:
    env = {"DEVICE": device, "CACHE_DIR": str(cache)}
    if model is None:
        return env | EMBEDDED_ENV
    return env | {"MODEL": model}


def bake(env: dict[str, str], snapshot_dir: Path) -> Path:
    """A process snapshot of the runtime ENV describes; returns the model directory it was built from."""
    from runtime.bootstrap import resolve_model
    from runtime.config import Settings
    from snapshots.process import bake_process_snapshot

    settings = Settings.from_env(env)
    model_dir = resolve_model(settings)
    bake_process_snapshot(settings, model_dir, snapshot_dir)
    return model_dir


def stages_of(health: dict) -> dict[str, float]:
    if health.get("restore_path") != "process":
        raise RuntimeError(f"restored {health.get('restore_path')!r}, not process: {health.get('skipped')}")
    stages = {s["stage"]: s for s in health["stages"]}
    restore, detail = stages["restore"], stages["restore"].get("detail", {})
    before = detail.get("before_criu_s", 0.0)
    handoff = restore["seconds"] - before - detail["criu_s"] - detail.get("cuda_s", 0.0)
    # older runtimes do not report bootstrap_s: on the CPU the device phase starts at cuda_init
    bootstrap = detail.get("bootstrap_s", stages["cuda_init"]["start_s"] - restore["end_s"])
    times = {"spawn_to_restore_s": restore["start_s"], "before_criu_s": before, "criu_s": detail["criu_s"],
             "handoff_s": round(handoff, 4), "bootstrap_s": round(bootstrap, 4),
             "spawn_to_ready_s": stages["ready"]["end_s"]}
    verify = next(s for s in health["stages"] if s["stage"] == "snapshot_verify"
                  and s["detail"]["snapshot"] == "process")  # the image's check, not the materialized state's
    restored_at = restore["start_s"] + before + detail["criu_s"] + detail.get("cuda_s", 0.0)
    times["verify_after_criu_s"] = round(max(0.0, verify["end_s"] - restored_at), 4)
    if not stages["cuda_init"].get("detail", {}).get("ahead"):  # a context made ahead starts at the hand-over
        times["to_device_phase_s"] = round(stages["cuda_init"]["start_s"] - restore["end_s"], 4)
    return times


def imports_before_restore(snapshot_dir: Path, env: dict[str, str]) -> dict:
    """One boot with -X importtime: the modules imported before the restore, the top ones by their time."""
    with tempfile.NamedTemporaryFile("w+", suffix=".log") as log:
        boot(snapshot_dir, env | {"PYTHONPROFILEIMPORTTIME": "1"}, stderr=log)
        log.seek(0)
        text = log.read()
    before = text.split("CRIU restored", 1)[0]
    rows = [m.groups() for m in re.finditer(r"import time:\s+(\d+) \|\s+(\d+) \|( *)(\S+)", before)]
    top = [(name, int(cum)) for _, cum, indent, name in rows if indent == " "]
    return {"modules": len(rows), "total_s": round(sum(c for _, c in top) / 1e6, 4),
            "top_s": {name: round(c / 1e6, 4) for name, c in sorted(top, key=lambda t: -t[1])[:12]}}


def interpreter_start_s(runs: int = 5) -> dict[str, float]:
    def timed(*args: str) -> float:
        times = []
        for _ in range(runs):
            started = time.perf_counter()
            subprocess.run([sys.executable, *args, "-c", "pass"], check=True)
            times.append(time.perf_counter() - started)
        return round(statistics.median(times), 4)

    return {"python": timed(), "python_no_site": timed("-S")}


def image_memory(env: dict[str, str], model_dir: Path) -> dict[str, float]:
    """MiB of anonymous memory per mapping kind of a runtime frozen as the bake freezes it."""
    from runtime.config import Settings
    from snapshots import checkpoint
    from snapshots.fingerprint import resolved_device

    settings = Settings.from_env(env)
    device = resolved_device(settings)
    with tempfile.TemporaryDirectory(prefix="bench-freeze-") as work:
        # this process's environment under the settings, as the bake's: the child needs its PATH and PYTHONPATH
        frozen = checkpoint.freeze_runtime("process", model_dir, checkpoint.settings_environ(settings)
                                           | {"DEVICE": device}, Path(work), pid_namespace=device != "cuda")
        try:
            smaps = Path(f"/proc/{frozen.pid}/smaps").read_text()
        finally:
            os.kill(frozen.pid, signal.SIGKILL)  # in a pid namespace, its init: `unshare` alone would leave it
            frozen.wrapper.kill()
            frozen.wrapper.wait()
            frozen.release()
    return memory_by_kind(smaps)


def memory_by_kind(smaps: str) -> dict[str, float]:
    """heap (malloc's brk heap), anonymous mmaps (Python's arenas, large allocations), stack, and per file
    its private copied pages (relocated and written data of libraries)."""
    kib: collections.Counter[str] = collections.Counter()
    kind = "anonymous"
    for line in smaps.splitlines():
        head = line.split(None, 5)
        if re.match(r"^[0-9a-f]+-[0-9a-f]+$", head[0]):
            name = head[5].strip() if len(head) > 5 else ""
            kind = ("anonymous" if not name else name.strip("[]") if name.startswith("[")
                    else "file " + Path(name).name)
        elif line.startswith("Anonymous:"):
            kib[kind] += int(head[1])
    files = sum(v for k, v in kib.items() if k.startswith("file "))
    out = {k: round(v / 1024, 1) for k, v in kib.most_common() if not k.startswith("file ") and v}
    out["files (private pages)"] = round(files / 1024, 1)
    for name, v in [(k, v) for k, v in kib.most_common() if k.startswith("file ")][:6]:
        out[name] = round(v / 1024, 1)
    out["total"] = round(sum(kib.values()) / 1024, 1)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", help="model directory, GGUF or layout (default: the embedded model)")
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    p.add_argument("--snapshot-dir", type=Path, help="holds process/ already (default: bake one)")
    p.add_argument("--runs", type=int, default=5)
    p.add_argument("--out", type=Path)
    a = p.parse_args()
    work = Path(tempfile.mkdtemp(prefix="bench-restore-stages-"))
    env = settings_env(a.model, a.device, Path(os.environ.get("CACHE_DIR", work / "cache")))
    snapshot_dir = a.snapshot_dir or work / "snapshots"
    if a.snapshot_dir is None:
        bake(env, snapshot_dir)
    manifest = json.loads((snapshot_dir / "process" / "manifest.json").read_text())
    model_dir = Path(manifest["model_dir"])
    boot_env = env | {"RESTORE": "process"}
    runs = [stages_of(boot(snapshot_dir, boot_env)) for _ in range(a.runs)]
    result = {
        "model": a.model or "embedded", "device": a.device, "cpus": os.cpu_count(), "runs": runs,
        "median": {k: round(statistics.median(r[k] for r in runs), 4) for k in STAGE_KEYS if k in runs[0]},
        "interpreter_start_s": interpreter_start_s(),
        "imports_before_restore": imports_before_restore(snapshot_dir, boot_env),
        "image_pages_mib": round(sum(size for name, size in manifest["files"].items()
                                     if name.startswith("pages-")) / 2**20, 1),
        "frozen_memory_mib": image_memory(env, model_dir),
    }
    print(json.dumps(result, indent=1))
    if a.out:
        a.out.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
