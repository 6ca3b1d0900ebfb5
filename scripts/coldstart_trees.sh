#!/usr/bin/env bash
# Process restores of several commits of the project side by side on one GPU machine, their rounds interleaved:
# what a change to the start costs or gains, on one machine and in one run. Each arm NAME=REV gets its own tree
# (`git archive REV`, or REV a tarball `git archive` made, for a machine with the files but not the history)
# and its own process snapshot, baked by that tree from one layout of SHAPE (the first arm's
# faas-build makes it, with the materialized state every arm shares: arms whose engines allocate alike), with its
# start pages where the tree lists them (docs/snapshots.md). A round
# runs `faas-bench coldstart --modes process --repeat 1` in each arm, page cache CACHE (warm or dropped: then
# each start beside its own reference read of the weights). Results in $RESULTS/NAME-ROUND (default results/).
# IDLE_S (default 0) waits that many seconds before each start: a GPU without a CUDA client for a while makes the
# next start's driver slower (docs/benchmarks.md, "The CUDA context is the driver's work"), and a start on a
# function's own GPU comes after such a pause. `scripts/merge_trees.py` gathers a run into one JSON.
# Run scripts/gpu_suite.sh setup first. DEVICE (default cuda) runs it on another device (DEVICE=cpu: the
# process snapshot alone is baked, there being no materialized state without a GPU).
#
#   scripts/coldstart_trees.sh llama-3-8b 2 dropped base=ca3069e handover=ee8de48
set -euo pipefail
cd "$(dirname "$0")/.."
shape=$1 rounds=$2 cache=$3; shift 3
RESULTS=$(realpath -m "${RESULTS:-results}"); mkdir -p "$RESULTS"
WORK=${WORK:-/tmp/thawllm-trees}
PY=${PYTHON:-python3}
DEVICE=${DEVICE:-cuda}
SITE=${SITE:-/tmp/site}
model=${MODELS:-/tmp/thawllm-models}/$shape
suffix=$("$PY" -c 'import sysconfig; print(sysconfig.get_config_var("EXT_SUFFIX"))')
say() { echo "coldstart_trees [$(date +%H:%M:%S)] $*" >&2; }

[ -d "$model" ] || PYTHONPATH="$SITE:$PWD" "$PY" -c "from pathlib import Path; \
from scripts.model_shapes import make_random_model_dir as m; m(Path('$model'), '$shape')"
rm -rf "$WORK"; mkdir -p "$WORK"
layout=$WORK/layout first=
for arm in "$@"; do
    name=${arm%%=*} rev=${arm#*=} tree=$WORK/${arm%%=*}
    mkdir -p "$tree"
    if [ -f "$rev" ]; then tar -x -C "$tree" -f "$rev"; else git archive "$rev" | tar -x -C "$tree"; fi
    cc -O2 -shared -fPIC "$tree/runtime/weights/native_reader.c" -ldl -o "$tree/runtime/weights/_native_reader$suffix"
    # bytecode, as an image holds it (scripts/gpu_suite.sh setup): else each start compiles the bootstrap's sources
    "$PY" -m compileall -q -j 0 "$tree/runtime" "$tree/snapshots" "$tree/handlers" > /dev/null
    say "baking $name ($rev)"
    if [ -z "$first" ]; then
        (cd "$tree" && DEVICE="$DEVICE" PYTHONPATH="$SITE:$tree" "$PY" -m snapshots.build --model "$model" --out "$layout" \
            --snapshot-dir "$tree.snapshots" --quiet --snapshots "$([ "$DEVICE" = cpu ] && echo process || echo materialized,process)" \
            --time-restores 0)
        first=$tree
    else
        mkdir -p "$tree.snapshots"
        if [ -d "$first.snapshots/materialized" ]; then cp -r "$first.snapshots/materialized" "$tree.snapshots/"; fi
        # and, in a tree that has them, the start pages, as its faas-build would list them
        (cd "$tree" && DEVICE="$DEVICE" MODEL="$layout" SNAPSHOT_DIR="$tree.snapshots" PYTHONPATH="$SITE:$tree" "$PY" -c "
from pathlib import Path
from runtime.config import Settings
from snapshots.bake import bake_snapshots
print(*bake_snapshots(Settings.from_env(), Path('$layout'), kinds=('process',)), sep='\n')
try:
    from snapshots.start_pages_record import record_start_pages
except ImportError:
    pass
else:
    record_start_pages(Path('$layout'), Path('$tree.snapshots'), 'process')")
    fi
done
for round in $(seq "$rounds"); do
    for arm in "$@"; do
        name=${arm%%=*} tree=$WORK/${arm%%=*}
        say "round $round: $name"
        sleep "${IDLE_S:-0}"
        (cd "$tree" && PYTHONPATH="$SITE:$tree" "$PY" -m runtime.bench.cli coldstart --model "$layout" \
            --baseline-model "$model" --snapshot-dir "$tree.snapshots" --device "$DEVICE" --repeat 1 --page-cache "$cache" \
            --modes process --out "$RESULTS/$name-$round")
    done
done
