#!/usr/bin/env bash
# The GPU figures of docs/benchmarks.md and the GPU tests, in steps, on a CUDA machine that may have no
# network: Python packages from a folder of wheels, criu from .deb files (scripts/install_criu.sh
# --download-only), models of real shapes with random weights (scripts/model_shapes.py).
#
#   scripts/gpu_suite.sh STEP...        e.g. setup tests coldstart:qwen2-1.5b coldstart:llama-3-8b
#
# Steps:
#   setup               wheels from $WHEELS (default .whl, if present) into /tmp/site, criu from $DEBS
#                       (default .debs), the loader's native reader compiled in place, bytecode written
#   tests               every GPU-marked test (or those in $TEST_FILES); pytest's -rA output and junit XML
#                       into $RESULTS
#   model:SHAPE         a random-weight model directory of SHAPE in $MODELS (seed 0)
#   bake:SHAPE          faas-build: its layout and every snapshot this machine can bake (timed in turns;
#                       $BUILD_ARGS added, e.g. --snapshots process,gpu --time-restores 0)
#   coldstart:SHAPE     faas-bench coldstart over every restore path and transformers, page cache warm
#                       ($COLDSTART_MODES: other --modes, e.g. gpu,process,process-after,cold)
#   coldstart-dropped:SHAPE   the same with the page cache dropped before each start, beside the disk's
#                       parallel read of the model
#   verify:SHAPE        scripts/bench_snapshot_verify.py on SHAPE's process and gpu snapshots: what checking
#                       the image files adds to a restore
#   auto:SHAPE          faas-bootstrap with RESTORE=auto on the baked snapshots: the path it took and the
#                       order faas-build measured (its /health), into $RESULTS/auto-$GPU-SHAPE.json
#   trace:SHAPE         faas-bench trace on SHAPE's layout and snapshots ($TRACE_ARGS added: --modes, --rates,
#                       --requests, --max-instances, ...), into $RESULTS/trace-$GPU-SHAPE[-$TRACE_NAME];
#                       TRACE_COPIES=N: N snapshot directories (the $COPY_KINDS snapshots, default gpu,process,
#                       baked again for each), one per instance running at once, each in a pid namespace
#   serving:SHAPE       scripts/bench_serving.py (throughput, prefix caching, chunked prefill; $SERVING_ARGS added)
#   probe               scripts/probe_cuda_start.py: the driver's load, cuInit, the context, first cuBLAS call
#   context-after-idle:SHAPE   scripts/probe_context_after_idle.py on SHAPE's snapshots ($ROUNDS, default 5):
#                       a start's CUDA context after 4 s without a CUDA client, and with a process holding the driver
#   switch              faas-bench switch (several models in one instance; $SWITCH_ARGS added)
#
# Results (JSON, PNG, logs, junit) go to $RESULTS (default results/), named with the GPU ($GPU: h100, h200,
# from nvidia-smi). Each step prints what it runs.
set -euo pipefail
cd "$(dirname "$0")/.."

RESULTS=${RESULTS:-results}
MODELS=${MODELS:-/tmp/thawllm-models}
WHEELS=${WHEELS:-.whl}
DEBS=${DEBS:-.debs}
REPEAT=${REPEAT:-3}
PY=${PYTHON:-python3}
mkdir -p "$RESULTS" "$MODELS"
export PYTHONUNBUFFERED=1 PYTHONPATH="/tmp/site:$PWD${PYTHONPATH:+:$PYTHONPATH}"

say() { echo "gpu_suite [$(date +%T)] $*"; }

gpu_tag() {
    local name
    name=$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1)
    case $name in
        *H200*) echo h200 ;;
        *H100*) echo h100 ;;
        *) echo gpu ;;
    esac
}
GPU=${GPU:-$(gpu_tag)}

setup() {
    if [ -d "$WHEELS" ]; then
        say "installing $(ls "$WHEELS"/*.whl | wc -l) wheels from $WHEELS into /tmp/site"
        "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
            "$WHEELS"/*.whl
    fi
    if [ -d "$DEBS" ] && [ "$(id -u)" = 0 ]; then
        say "installing criu from $DEBS"
        bash scripts/install_criu.sh --from "$DEBS"
    fi
    local suffix
    suffix=$("$PY" -c 'import sysconfig; print(sysconfig.get_config_var("EXT_SUFFIX"))')
    say "compiling the native reader"
    cc -O2 -shared -fPIC runtime/weights/native_reader.c -ldl -o "runtime/weights/_native_reader$suffix"
    # bytecode, as pip's install writes it into the image: a start reads it rather than compiling the sources
    # (PYTHONDONTWRITEBYTECODE, set in the image, stops only the writing)
    say "compiling bytecode"
    "$PY" -m compileall -q -j 0 runtime snapshots handlers scripts $([ -d /tmp/site ] && echo /tmp/site) >/dev/null
    nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
}

tests() {
    say "GPU tests"
    # only the files that hold GPU tests: the others may import packages (moto) a GPU image need not have
    local files
    files=${TEST_FILES:-$(grep -rlE "pytest\.mark\.gpu" tests --include='test_*.py' | sort)}
    "$PY" -m pytest -q -rA -m gpu --junitxml="$RESULTS/gpu-tests.xml" $files 2>&1 | tee "$RESULTS/gpu-tests.txt" \
        || say "GPU tests failed (the steps after this one still run)"
}

model_dir() { echo "$MODELS/$1"; }

model() {
    say "model $1"
    "$PY" -c "from pathlib import Path; from scripts.model_shapes import make_random_model_dir as m; \
m(Path('$(model_dir "$1")'), '$1')"
}

bake() {
    local shape=$1 dir
    dir=$(model_dir "$shape")
    [ -d "$dir" ] || model "$shape"
    rm -rf "$dir-baked"
    say "faas-build $shape"
    # shellcheck disable=SC2086
    "$PY" -m snapshots.build --model "$dir" --out "$dir-baked/layout" --snapshot-dir "$dir-baked/snapshots" \
        --quiet ${BUILD_ARGS:-} 2>&1 | tee "$RESULTS/bake-$shape.txt"
}

coldstart() {
    local shape=$1 cache=$2 dir
    dir=$(model_dir "$shape")
    [ -d "$dir-baked" ] || bake "$shape"
    local name="coldstart-$GPU-$shape"
    [ "$cache" = dropped ] && name="$name-dropped"
    say "faas-bench coldstart $shape (page cache $cache)"
    "$PY" -m runtime.bench.cli coldstart --model "$dir-baked/layout" --baseline-model "$dir" \
        --snapshot-dir "$dir-baked/snapshots" --device cuda --repeat "$REPEAT" --page-cache "$cache" \
        ${COLDSTART_MODES:+--modes "$COLDSTART_MODES"} --out "$RESULTS/$name"
}

context_after_idle() {
    local shape=$1 dir
    dir=$(model_dir "$shape")
    [ -d "$dir-baked" ] || bake "$shape"
    say "probe_context_after_idle $shape"
    "$PY" scripts/probe_context_after_idle.py --model "$dir-baked/layout" --snapshot-dir "$dir-baked/snapshots" \
        --rounds "${ROUNDS:-5}" --out "$RESULTS/context-after-idle-$GPU-$shape.json"
}

verify() {
    local shape=$1 dir kind
    dir=$(model_dir "$shape")
    [ -d "$dir-baked" ] || bake "$shape"
    for kind in process gpu; do
        say "bench_snapshot_verify $shape $kind"
        MODEL="$dir-baked/layout" DEVICE=cuda "$PY" scripts/bench_snapshot_verify.py \
            --snapshot-dir "$dir-baked/snapshots" --kind "$kind" --out "$RESULTS/snapshot-verify-$GPU-$shape-$kind.json"
    done
}

auto_start() {
    local shape=$1 dir
    dir=$(model_dir "$shape")
    [ -d "$dir-baked" ] || bake "$shape"
    say "faas-bootstrap RESTORE=auto $shape"
    "$PY" - "$dir-baked" "$RESULTS/auto-$GPU-$shape.json" <<'EOF'
import asyncio, json, sys
from pathlib import Path
import httpx
from runtime.bench.instance import Instance

async def main(baked: Path, out: Path) -> None:
    settings = {"MODEL": str(baked / "layout"), "SNAPSHOT_DIR": str(baked / "snapshots"), "DEVICE": "cuda"}
    instance = Instance.spawn("auto", settings, out.with_suffix(".log"))
    try:
        async with httpx.AsyncClient() as client:
            health = await instance.wait_ready(client, 900)
    finally:
        await instance.stop()
    report = {"restore_path": health["restore_path"], "restore_order": health.get("restore_order"),
              "skipped": health["skipped"], "spawn_to_ready_s": round(instance.ready_at - instance.spawned_at, 4)}
    out.write_text(json.dumps(report, indent=1))
    print(json.dumps(report, indent=1))

asyncio.run(main(Path(sys.argv[1]), Path(sys.argv[2])))
EOF
}

trace() {
    local shape=$1 dir
    dir=$(model_dir "$shape")
    [ -d "$dir-baked" ] || bake "$shape"
    local snapshots=(--snapshot-dir "$dir-baked/snapshots") dirs=$dir-baked/snapshots k
    if [ "${TRACE_COPIES:-1}" -gt 1 ]; then
        # two restores of one CRIU snapshot on one host clash over its baked pids and handoff socket
        for k in $(seq 2 "$TRACE_COPIES"); do
            if [ ! -d "$dir-baked/snapshots-$k" ]; then
                say "baking snapshot copy $k of $shape (${COPY_KINDS:-gpu,process})"
                MODEL="$dir-baked/layout" "$PY" -m runtime.bench.fresh_snapshots "$dir-baked/layout" \
                    "$dir-baked/snapshots-$k" "${COPY_KINDS:-gpu,process}"
            fi
            dirs=$dirs,$dir-baked/snapshots-$k
        done
        snapshots=(--instance-snapshot-dirs "$dirs" --pid-namespaces)
    fi
    say "faas-bench trace $shape"
    # shellcheck disable=SC2086
    "$PY" -m runtime.bench.cli trace --model "$dir-baked/layout" "${snapshots[@]}" \
        --device cuda --out "$RESULTS/trace-$GPU-$shape${TRACE_NAME:+-$TRACE_NAME}" ${TRACE_ARGS:-}
}

serving() {
    local dir
    dir=$(model_dir "$1")
    [ -d "$dir" ] || model "$1"
    say "bench_serving $1"
    # SERVING_ARGS: more bench_serving arguments (--parts prefix mix, --no-transformers, ...)
    # shellcheck disable=SC2086
    "$PY" scripts/bench_serving.py --model "$dir" --out "$RESULTS/serving-$GPU-$1.json" ${SERVING_ARGS:-}
}

switch() {
    say "faas-bench switch"
    # SWITCH_ARGS: more faas-bench switch arguments (--shapes, --rates, --duration, ...)
    # shellcheck disable=SC2086
    "$PY" -m runtime.bench.cli switch --models-dir "$MODELS" --device cuda --out "$RESULTS/switch-$GPU" \
        ${SWITCH_ARGS:-}
}

for step in "$@"; do
    case $step in
        setup) setup ;;
        tests) tests ;;
        model:*) model "${step#model:}" ;;
        bake:*) bake "${step#bake:}" ;;
        coldstart:*) coldstart "${step#coldstart:}" warm ;;
        coldstart-dropped:*) coldstart "${step#coldstart-dropped:}" dropped ;;
        auto:*) auto_start "${step#auto:}" ;;
        verify:*) verify "${step#verify:}" ;;
        trace:*) trace "${step#trace:}" ;;
        serving:*) serving "${step#serving:}" ;;
        switch) switch ;;
        context-after-idle:*) context_after_idle "${step#context-after-idle:}" ;;
        probe) say "probe_cuda_start"; "$PY" scripts/probe_cuda_start.py --out "$RESULTS/cuda-start-$GPU.json" ;;
        *) echo "gpu_suite: unknown step $step" >&2; exit 2 ;;
    esac
done
say "done"
