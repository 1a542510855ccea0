#!/usr/bin/env bash
# The GPU check: one prepared command for the device machine (one NVIDIA GPU; Python 3.12,
# torch 2.11 + CUDA, triton 3.6, numpy; no package registry). From a fresh clone:
#
#   here:        make install && make gpu-wheels          (.whl/: every other wheel, ~40 MiB)
#   device tool: run(command="bash scripts/gpu-check.sh", carry=[".whl"], timeout_s=560)
#
# No venv: the device's python3 holds torch, so the carried wheels go to /tmp/site (--no-deps,
# --no-index) and aotc runs from this checkout through PYTHONPATH. Every step has its own
# timeout (together <= 8 min) and a failure never stops the steps after it. The most valuable
# figure comes first: compile toy-llama for cuda, then CUDA graphs (eager / no graphs /
# piecewise / full at 1, 8, 64 tokens, capture seconds, pool bytes, max error vs eager), then
# the warm start checked against eager, then the tests (the CUDA-marked ones first).
# Everything lands in $OUT; $OUT/summary.json is the one record to read.
#
#   bash scripts/gpu-check.sh --cpu    the same steps on a CPU machine (here): CUDA-only parts
#                                      are reported "skipped", so the script itself is tested
set -uo pipefail
MODE=gpu
[ "${1:-}" = "--cpu" ] && MODE=cpu
OUT=${OUT:-/tmp/aotc-gpu-out}
mkdir -p "$OUT"
: > "$OUT/steps.tsv"
export PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1
ROOT=$(cd "$(dirname "$0")/.." && pwd)
cd "$ROOT"
WORK=$(mktemp -d /tmp/aotc-check.XXXX)
STORE=$WORK/store
T0=$(date +%s)

# step NAME SECONDS CMD...: run with a time limit, log to $OUT/NAME.log, record rc and seconds
step() {
    local name=$1 limit=$2 t rc
    shift 2
    t=$(date +%s)
    echo "== $name (<= ${limit}s)"
    timeout --kill-after=5 "$limit" "$@" > "$OUT/$name.log" 2>&1
    rc=$?
    printf '%s\t%s\t%s\t%s\n' "$name" "$rc" "$(( $(date +%s) - t ))" "$limit" >> "$OUT/steps.tsv"
    tail -4 "$OUT/$name.log" | cut -c1-300
    echo "   rc=$rc in $(( $(date +%s) - t ))s"
    return 0
}

if [ "$MODE" = gpu ]; then
    PY=python3
    DEVICE=cuda
    JOBS=${AOTC_GPU_JOBS:-8}
    # aotc from this checkout: map aotc.cache / aotc.cli the way package-dir does
    [ -e aotc/cache ] || ln -s ../cache aotc/cache
    [ -e aotc/cli ] || ln -s ../cli aotc/cli
    export PYTHONPATH=/tmp/site:$ROOT
    step wheels 40 bash -c 'ls .whl/*.whl >/dev/null && python3 -m pip install -q --no-index --no-deps \
        --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl'
else
    PY=${AOTC_CHECK_PYTHON:-$ROOT/.venv/bin/python}
    DEVICE=cpu
    JOBS=2
    # the carried set is checked, not installed (this machine's Python is not 3.12)
    step wheels 10 bash -c 'for n in click sqlite_utils zstandard pyyaml cryptography pytest transformers \
        safetensors tokenizers huggingface_hub; do ls .whl/${n}-*.whl >/dev/null 2>&1 || \
        { echo "missing in .whl/: $n (run make gpu-wheels)"; exit 1; }; done; echo "$(ls .whl | wc -l) wheels"'
fi
step versions 20 $PY -c "import torch, sys; print('python', sys.version.split()[0], 'torch', torch.__version__,
    'cuda', torch.cuda.is_available() and torch.cuda.get_device_name())"

sed -e "s/^device: cpu/device: $DEVICE/" -e 's/^capture_sizes: .*/capture_sizes: [1, 2, 4, 8, 16, 32, 64]/' \
    manifests/toy-llama.yaml > "$WORK/toy.yaml"
step compile 100 bash -c "$PY -m aotc.cli --store $STORE compile $WORK/toy.yaml -j $JOBS --json > $OUT/compile.json"
if [ "$MODE" = gpu ]; then
    step cuda_graphs 80 $PY bench/cuda_graphs.py "$WORK/toy.yaml" "$STORE" --sizes 1,8,64 --iters 30 \
        --out "$OUT/cuda_graphs.json"
else
    step cuda_graphs 80 $PY bench/cuda_graphs.py "$WORK/toy.yaml" "$STORE" --sizes 1,8,64 --iters 5 \
        --out "$OUT/cuda_graphs.json"
fi
step warm_start 50 bash -c "$PY -m aotc.cli --store $STORE run $WORK/toy.yaml --sizes 1,8,64,100 --check-eager \
    --json > $OUT/warm_start.json"

TESTS="tests/test_pipeline_pieces.py tests/test_wrapper.py tests/test_cudagraph.py tests/test_store.py"
PYTEST="$PY -m pytest -q -p no:cacheprovider -p no:warnings"
if [ "$MODE" = gpu ]; then
    step tests_cuda 90 $PYTEST -m cuda --junitxml="$OUT/tests_cuda.xml" $TESTS
    step tests 100 $PYTEST -m "not cuda" --junitxml="$OUT/tests.xml" ${AOTC_GPU_TESTS:-tests/test_store.py tests/test_wrapper.py tests/test_cudagraph.py}
else
    step tests_cuda 30 $PYTEST -m cuda --junitxml="$OUT/tests_cuda.xml" $TESTS
    step tests 240 $PYTEST -m "not cuda" --junitxml="$OUT/tests.xml" ${AOTC_GPU_TESTS:-tests/test_store.py tests/test_wrapper.py tests/test_cudagraph.py}
fi

$PY scripts/gpu_summary.py "$OUT" "$MODE" "$(( $(date +%s) - T0 ))" > "$OUT/summary.json" 2> "$OUT/summary.err"
cat "$OUT/summary.json"
rm -rf "$WORK"
