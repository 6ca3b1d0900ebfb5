#!/usr/bin/env bash
# Decode throughput of this tree and of another checkout of the project, one after the other on the same GPU:
# what a change to the kernels costs or gains at every step. BASE_TREE: a directory holding the other tree
# (e.g. `git worktree add /tmp/base REV`, or `git archive REV | tar -x -C DIR` where there is no .git); the
# other arguments go to scripts/bench_decode.py in both. Writes decode-this.json and decode-base.json into
# $RESULTS (default results/).
#
#   scripts/bench_decode_two_trees.sh /tmp/base --batch 1 8 --steps 64
set -euo pipefail
cd "$(dirname "$0")/.."
base=$(realpath "$1"); shift
RESULTS=$(realpath -m "${RESULTS:-results}"); mkdir -p "$RESULTS"
PY=${PYTHON:-python3}
suffix=$("$PY" -c 'import sysconfig; print(sysconfig.get_config_var("EXT_SUFFIX"))')
cc -O2 -shared -fPIC "$base/runtime/weights/native_reader.c" -ldl -o "$base/runtime/weights/_native_reader$suffix"
echo "bench_decode: this tree" >&2
PYTHONPATH="/tmp/site:$PWD" "$PY" scripts/bench_decode.py "$@" --out "$RESULTS/decode-this.json"
echo "bench_decode: $base" >&2
(cd "$base" && PYTHONPATH="/tmp/site:$base" "$PY" scripts/bench_decode.py "$@" --out "$RESULTS/decode-base.json")
