"""A sampled profile of one start (PROFILE_START): every thread's Python stack, about every millisecond, from
the moment the server's timeline exists (in a restored runtime: right after the take-over) until its first
token, written into a folder, one file per process. It shows what the timeline's stages do not split: which
thread waited on what (an import, a subprocess, a kernel's first launch) on the way to the first token. A
native call shows as the Python line that made it. The sampling holds the GIL at every sample: a profiled start
is slower (docs/bench.md, "Profiling a start"), so a profile attributes time and the timeline's stages measure
it. `scripts/read_start_profile.py` prints one.

The file is JSON lines, appended every FLUSH_S so that a process stopped right after its first token leaves
what it sampled: {"stack": id, "frames": [...]} the first time a stack is seen (innermost frame first),
{"samples": [[seconds since spawn, thread, stack id], ...]}, and last, if the process lives that long, the
timeline's stages ({"stages": [...]})."""

from __future__ import annotations

import json
import os
import sys
import threading
import time
from pathlib import Path

from runtime import timeline as stages
from runtime.timeline import Timeline

#: seconds between samples and between appends to the file; a start that serves no token stops being
#: sampled after LIMIT_S
INTERVAL_S = 0.001
FLUSH_S = 0.05
LIMIT_S = 60.0
#: frames kept per stack, innermost first
DEPTH = 40


class StartProfile:
    def __init__(self, folder: Path, timeline: Timeline) -> None:
        self.path = folder / f"start-{os.getpid()}-{int(time.time() * 1000)}.jsonl"
        self._timeline = timeline
        self._stacks: dict[tuple[str, ...], int] = {}
        self._thread = threading.Thread(target=self._run, name="start-profile", daemon=True)

    def start(self) -> None:
        """Raises OSError where the folder cannot be made or written to."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._out = self.path.open("a")
        self._thread.start()

    def _run(self) -> None:
        me = threading.get_ident()
        names = _thread_names()
        stop_at = time.time() + LIMIT_S
        flushed = time.time()
        lines: list[dict] = []
        samples: list[list] = []
        with self._out as out:
            while time.time() < stop_at:
                now = time.time()
                if now - flushed >= FLUSH_S:
                    names = _thread_names()  # again: an ident that ended may have been given to a new thread
                    if stop_at > now + FLUSH_S and self._timeline.get(stages.FIRST_TOKEN) is not None:
                        stop_at = now + FLUSH_S  # the first token's own thread, a little past it
                    _append(out, lines + [{"samples": samples}])
                    lines, samples, flushed = [], [], now
                at = round(now - self._timeline.origin, 5)
                for ident, frame in sys._current_frames().items():
                    if ident == me:
                        continue
                    if ident not in names:  # a thread started since the names were taken
                        names = _thread_names()
                        names.setdefault(ident, str(ident % 100000))  # not one of threading's
                    samples.append([at, names[ident], self._stack_id(frame, lines)])
                time.sleep(INTERVAL_S)
            _append(out, lines + [{"samples": samples}, {"stages": self._timeline.as_json()}])

    def _stack_id(self, frame, lines: list[dict]) -> int:
        frames = []
        while frame is not None and len(frames) < DEPTH:
            code = frame.f_code
            # the last two parts of the path say which module it is: engine/llm_engine.py
            frames.append(f"{'/'.join(code.co_filename.split('/')[-2:])}:{frame.f_lineno}:{code.co_name}")
            frame = frame.f_back
        key = tuple(frames)
        found = self._stacks.get(key)
        if found is None:
            found = self._stacks[key] = len(self._stacks)
            lines.append({"stack": found, "frames": frames})
        return found


def _thread_names() -> dict[int, str]:
    # the ident's tail tells apart threads of one name (the weight readers)
    return {t.ident: f"{t.name} {t.ident % 100000}" for t in threading.enumerate() if t.ident is not None}


def _append(out, lines: list[dict]) -> None:
    out.write("".join(json.dumps(line) + "\n" for line in lines))
    out.flush()
