"""Shared fixtures. Compiled fixtures are session-scoped: one store, each model compiled once."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parent.parent
HELPERS = ROOT / "tests" / "helpers"


@pytest.fixture(autouse=True)
def _no_leaked_environment():
    """After each test, the variables an imported library (vLLM) set in this process under
    Inductor's, OpenMP's or the loader's names are put back as the session found them: this
    process read Inductor's at import, and a key computed here must describe it (the toolchain
    memo's fingerprint reads the environment)."""
    yield
    for name in [n for n in os.environ if n.startswith(_LEAKED_PREFIXES) and os.environ[n] != _SESSION_ENV.get(n)]:
        if name in _SESSION_ENV:
            os.environ[name] = _SESSION_ENV[name]
        else:
            del os.environ[name]


@pytest.fixture(autouse=True)
def _quick_tests_compile_nothing(request):
    """A test not marked ``slow`` (``make test-quick``) compiles nothing in this process: it fails
    when aotc compiled a piece or Inductor compiled a graph while it ran (a child process that
    compiles is the slow mark's business too: such tests start children from this process's
    helpers, which are all marked)."""
    if request.node.get_closest_marker("slow") is not None:
        yield
        return
    from aotc._torch.inductor_facts import counters_snapshot

    before = counters_snapshot()
    yield
    after = counters_snapshot()
    compiled = {k: after[k] - before[k] for k in ("compiles", "inductor_compiles") if after[k] != before[k]}
    assert not compiled, f"a test not marked slow compiled ({compiled}): mark it @pytest.mark.slow"


@pytest.fixture
def store(tmp_path: Path):
    """A fresh, empty store in a temp dir (real sqlite, real zstd)."""
    from aotc.cache import Store

    s = Store(tmp_path / "store")
    yield s
    s.close()


# The environment as the session found it. Importing vLLM (or building its engine config) sets
# variables in this process — TORCHINDUCTOR_CPP_DYNAMIC_THREADS, LD_PRELOAD, KMP_* — that change
# what Inductor compiles in a child which inherits them (cpp.dynamic_threads is read at import), so
# a child's key would differ from this process's: children get these as the session began.
_SESSION_ENV = dict(os.environ)
import torch._inductor.config  # noqa: E402,F401 - this process reads Inductor's variables now, before vLLM sets any
_LEAKED_PREFIXES = ("TORCHINDUCTOR_", "TORCH_COMPILE_", "TORCHDYNAMO_", "KMP_", "LD_PRELOAD", "OMP_")


def python_env() -> dict[str, str]:
    """Environment for subprocesses: this interpreter's packages, no inherited AOTC_STORE, and
    no variable an imported library (vLLM) set under Inductor's, OpenMP's or the loader's names."""
    env = dict(os.environ)
    for name in [n for n in env if n.startswith(_LEAKED_PREFIXES) and env[n] != _SESSION_ENV.get(n)]:
        if name in _SESSION_ENV:
            env[name] = _SESSION_ENV[name]
        else:
            del env[name]
    env.pop("AOTC_STORE", None)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH", "")]))
    return env


PYTHON = sys.executable
AOTC_CLI = [PYTHON, "-m", "aotc.cli"]  # the command line, run as a fresh process


def run_cli(*args: str, env: dict[str, str] | None = None, timeout: float = 300,
            check: bool = False) -> subprocess.CompletedProcess:
    """``aotc ARGS`` in a fresh process (this interpreter, ``python_env()``), output captured;
    with ``check`` a non-zero exit fails the test with the tail of stderr."""
    res = subprocess.run([*AOTC_CLI, *args], capture_output=True, text=True,
                         env=python_env() if env is None else env, timeout=timeout)
    if check:
        assert res.returncode == 0, res.stderr[-3000:]
    return res


def aotc_warnings(caplog) -> list[str]:
    """The warning lines aotc logged (its ``aotc`` logger and children), in order."""
    import logging

    return [r.getMessage() for r in caplog.records
            if r.name.split(".")[0] == "aotc" and r.levelno >= logging.WARNING]


def copy_store(src: Path, dst: Path) -> None:
    """Copy a store directory in a CHILD process: copying opens and closes the sqlite files, and
    closing any descriptor of a file drops every POSIX lock this process holds on it — including
    those of the store's live sqlite connections here (later writes then fail with "disk I/O
    error"). A child's descriptors are its own."""
    import subprocess

    subprocess.run([PYTHON, "-c", "import shutil, sys; shutil.copytree(sys.argv[1], sys.argv[2])",
                    str(src), str(dst)], check=True, timeout=120)


SIZES = [4]


def toy_manifest(tmp: Path, layers: int, name: str | None = None, **extra) -> Path:
    data = {
        "name": name or f"toy-{layers}",
        "model": {"factory": "aotc.models.toy_llama:build",
                  "kwargs": {"layers": layers, "hidden": 64, "heads": 4, "vocab": 128}},
        "inputs": [{"name": "input_ids", "dtype": "int64", "shape": ["tokens"], "high": 128},
                   {"name": "positions", "dtype": "int64", "shape": ["tokens"], "fill": "arange"}],
        "compile_sizes": SIZES, "capture_sizes": [1, 2, 4, 8], "max_tokens": 256,
        "splitting_ops": ["aotc::attention"],
    }
    data.update(extra)
    path = tmp / f"{data['name']}.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def tiny_manifest(tmp: Path, name: str = "toy-tiny", factory: str = "aotc.models.toy_llama:build") -> Path:
    """The cheapest real compile: 1 layer, dynamic shape only (2 unique pieces, 2 Inductor
    compiles) — for suites that compile in many processes. ``factory``: e.g. a copied source
    file ("mymodel.py:build", relative to ``tmp``) to edit afterwards."""
    data = {"name": name,
            "model": {"factory": factory,
                      "kwargs": {"layers": 1, "hidden": 32, "heads": 2, "vocab": 64}},
            "inputs": [{"name": "input_ids", "dtype": "int64", "shape": ["tokens"], "high": 64},
                       {"name": "positions", "dtype": "int64", "shape": ["tokens"], "fill": "arange"}],
            "compile_sizes": [], "max_tokens": 64, "splitting_ops": ["aotc::attention"]}
    path = tmp / f"{name}.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


@pytest.fixture(scope="session")
def compiled(tmp_path_factory):
    """toy-llama with 2 and 4 layers and a tiny HF Llama, compiled once into one store."""
    from aotc.cache import Store
    from aotc.compile.pipeline import compile_manifest
    from aotc._torch.inductor_facts import counters_snapshot

    tmp = tmp_path_factory.mktemp("compile")
    store = Store(tmp / "store")
    results = {}
    for layers in (2, 4):
        m = toy_manifest(tmp, layers)
        before = counters_snapshot()
        results[layers] = (m, compile_manifest(m, store=store), before, counters_snapshot())
    hf = hf_manifest(tmp)
    results["hf"] = (hf, compile_manifest(hf, store=store), None, None)
    return tmp, store, results


POSITION_SHIFT = 5  # positions arange + 5: a position fed to the wrong parameter shows


def hf_manifest(tmp: Path, dtype: str = "float32", name: str = "tiny-hf-llama", **extra) -> Path:
    """The shipped tiny HF Llama manifest over a model directory written with ``save_pretrained``
    (seeded random weights, safetensors), positions shifted by ``POSITION_SHIFT``, compile
    size 1 (the backed HF graph serves >= 2 tokens)."""
    model_dir = tmp / "hf-model"
    if not model_dir.is_dir():
        import torch
        from transformers import LlamaConfig, LlamaForCausalLM

        data = yaml.safe_load((ROOT / "manifests" / "tiny-hf-llama.yaml").read_text())
        torch.manual_seed(0)
        LlamaForCausalLM(LlamaConfig(**data["model"]["hf"]["config"])).save_pretrained(model_dir)
    data = yaml.safe_load((ROOT / "manifests" / "tiny-hf-llama.yaml").read_text())
    data["name"] = name
    data["model"]["hf"]["config"] = str(model_dir)
    data["model"]["weights"] = str(model_dir)
    data["inputs"][1]["low"] = POSITION_SHIFT
    data.update({"dtype": dtype, "compile_sizes": [1], **extra})
    path = tmp / f"{name}.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


@pytest.fixture(scope="session")
def oci(tmp_path_factory):
    """A real OCI registry (Debian's docker-registry 2.8) on 127.0.0.1 for this session; yields
    a function making a fresh repository URL (``oci://host:port/aotc/rN``), with ``.blobs``: the
    registry's blob storage directory (to play a hostile registry). Skips without the binary."""
    import itertools

    from tests.helpers.oci_registry import available, oci_registry

    if not available():
        pytest.skip("docker-registry is not installed (`apt-get install docker-registry`; .ci/run does)")
    with oci_registry(tmp_path_factory.mktemp("oci")) as (host, blobs):
        counter = itertools.count()

        def new_repo() -> str:
            return f"oci://{host}/aotc/r{next(counter)}"

        new_repo.blobs = blobs  # type: ignore[attr-defined]
        new_repo.host = host  # type: ignore[attr-defined]
        yield new_repo


@pytest.fixture(scope="session")
def s3(tmp_path_factory):
    """A real S3-compatible server (moto's standalone server) on 127.0.0.1 for this session,
    with the environment pointing boto3 at it; yields a function making a fresh empty bucket."""
    import itertools

    import boto3

    from tests.helpers.s3server import S3_ENV, s3_server

    with s3_server(str(tmp_path_factory.mktemp("s3") / "server.log")) as endpoint, \
            pytest.MonkeyPatch.context() as env:  # the variables are put back after the session
        for k, v in {**S3_ENV, "AOTC_S3_ENDPOINT": endpoint}.items():
            env.setenv(k, v)
        client = boto3.client("s3", endpoint_url=endpoint)
        counter = itertools.count()

        def new_bucket() -> str:
            name = f"fleet-{next(counter)}"
            client.create_bucket(Bucket=name)
            return name

        new_bucket.client = client  # type: ignore[attr-defined]
        new_bucket.endpoint = endpoint  # type: ignore[attr-defined]
        yield new_bucket


# The longest files first: `make test` runs the suite on both cores (pytest-xdist, one file per
# worker at a time), and a long file left for last would run alone at the end.
LONGEST_FIRST = ("test_vllm.py", "test_clients.py", "test_clients_more.py", "test_precompile.py", "test_crashes.py",
                 "test_key_soundness.py", "test_install.py",
                 "test_vllm_serve.py",
                 "test_bench.py", "test_backend.py", "test_lease.py", "test_concurrency.py",
                 "test_graph_coverage.py", "test_unpacked.py")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Put the files of ``LONGEST_FIRST`` first, in that order (the rest keep theirs)."""
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))
