#!/usr/bin/env bash
# make test-torch-compat: aotc's tests on the GPU machine's torch (2.11 by default), here on the
# CPU. A second venv (.venv-torch<ver>/) gets that torch from the registry (its CUDA build: a few
# GB, it runs on the CPU) and aotc's dev dependencies, without vLLM (it pins its own torch); then
# `make test-quick`'s selection plus the pipeline, loader and CUDA-graph stand-in tests.
set -euo pipefail
VER=${1:-2.11.0}
VENV=.venv-torch${VER//./}
PY=$VENV/bin/python
STAMP=$VENV/.installed-$VER
if [ ! -f "$STAMP" ] || [ pyproject.toml -nt "$STAMP" ]; then
    test -x "$PY" || python3 -m venv "$VENV"
    "$PY" -m pip install -q --upgrade pip
    "$PY" -m pip install -q "torch==$VER"
    "$PY" -m pip install -q -e '.[dev]' "torch==$VER"
    "$PY" -c "import torch; assert torch.__version__.startswith('$VER'), torch.__version__; print('torch', torch.__version__)"
    touch "$STAMP"
fi
rc=0  # both runs, whatever the first says
"$PY" -m pytest -q -p no:cacheprovider -m "not slow" tests || rc=1
"$PY" -m pytest -q -p no:cacheprovider tests/test_pipeline_pieces.py tests/test_loader.py tests/test_cudagraph.py || rc=1
exit $rc
