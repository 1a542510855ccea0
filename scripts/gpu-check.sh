#!/usr/bin/env bash
# One prepared check for a machine with an NVIDIA GPU (the device tool's H200: Python 3.12,
# torch 2.11 + CUDA, triton 3.6, no package registry). Installs aotc with --no-deps into a venv
# that sees the system torch, plus the wheels carried in .whl/ (sqlite-utils, zstandard, ...),
# then: the CUDA-marked tests and the torch-2.11 compatibility of the pipeline tests, and
# toy-llama compiled for cuda and warm-started, and CUDA graph latency/capture/memory
# (bench/cuda_graphs.py: eager vs aotc none / piecewise / full at 1, 8, 64 tokens).
# Usage (device tool): bash scripts/gpu-check.sh   (writes logs and JSON under $OUT)
set -uo pipefail
OUT=${OUT:-/tmp/aotc-gpu-out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
PY=python3  # the image's python3 holds torch; a venv of it would not see its packages
$PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
# aotc from this checkout, no install: map aotc.cache / aotc.cli the way package-dir does
[ -e aotc/cache ] || ln -s ../cache aotc/cache
[ -e aotc/cli ] || ln -s ../cli aotc/cli
export PYTHONPATH=/tmp/site:$PWD
nvidia-smi -L
$PY -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, torch.cuda.get_device_name())"

echo "== tests (store, manifest, pipeline pieces incl. CUDA) =="
# AOTC_GPU_TESTS narrows the run (e.g. "-m cuda tests/test_pipeline_pieces.py") when time is short
TESTS=${AOTC_GPU_TESTS:-tests/test_pipeline_pieces.py tests/test_wrapper.py tests/test_cudagraph.py tests/test_store.py}
timeout 420 $PY -m pytest -q -x -s -p no:cacheprovider -p no:logging -p no:warnings $TESTS 2>&1 \
    | tee "$OUT/tests.log" | grep -vE "^DEBUG" | tail -25

echo "== toy-llama on cuda: compile, then warm start in a fresh process =="
sed -e 's/^device: cpu/device: cuda/' -e 's/^capture_sizes: .*/capture_sizes: [1, 2, 4, 8, 16, 32, 64]/' \
    manifests/toy-llama.yaml > /tmp/toy-cuda.yaml
STORE=/tmp/aotc-gpu-store
t0=$(date +%s)
timeout 300 $PY -m aotc.cli --store $STORE compile /tmp/toy-cuda.yaml -j ${AOTC_GPU_JOBS:-8} --json > "$OUT/compile.json" 2> "$OUT/compile.err"
echo "compile rc=$? wall $(( $(date +%s) - t0 ))s"; tail -3 "$OUT/compile.err"
timeout 120 $PY -m aotc.cli --store $STORE run /tmp/toy-cuda.yaml --sizes 1,8,64,100 --check-eager --json > "$OUT/run.json" 2> "$OUT/run.err"
echo "run rc=$?"; tail -3 "$OUT/run.err"
$PY - "$OUT" <<'PYEOF'
import json, sys
out = sys.argv[1]
for name in ("compile.json", "run.json"):
    try:
        d = json.load(open(f"{out}/{name}"))
    except Exception as e:  # noqa: BLE001
        print(name, "unreadable:", e); continue
    keep = {k: d.get(k) for k in ("key", "pieces", "unique_pieces", "compiles", "traces", "seconds",
                                   "max_abs_err", "load_seconds", "phases", "sizes")}
    print(name, json.dumps(keep, indent=1)[:2500])
PYEOF

echo "== CUDA graphs: eager vs aotc none / piecewise / full at 1, 8, 64 tokens =="
timeout 150 $PY bench/cuda_graphs.py /tmp/toy-cuda.yaml $STORE --sizes 1,8,64 > "$OUT/cuda_graphs.json" 2> "$OUT/cuda_graphs.err"
echo "bench rc=$?"; tail -3 "$OUT/cuda_graphs.err"; cat "$OUT/cuda_graphs.json" | head -80
