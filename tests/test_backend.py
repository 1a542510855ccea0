"""``torch.compile(model, backend="aotc")``: the registered backend, its arguments, a graph key that
is the same in every fresh process and directory, and a second fresh process that compiles
nothing (toy model and a transformers model), matching eager."""

from __future__ import annotations

import gc
import json
import os
import subprocess
from pathlib import Path

import pytest
import torch

from tests.conftest import PYTHON, ROOT, aotc_warnings, python_env, run_cli

HELPER = ROOT / "tests" / "helpers" / "backend_run.py"


def _run(what: str, env: dict[str, str], *extra: str, cwd: Path | None = None) -> dict:
    res = subprocess.run([PYTHON, str(HELPER), what, *extra], capture_output=True, text=True,
                         env=env, cwd=cwd, timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    return {**json.loads(res.stdout.strip().splitlines()[-1]), "stderr": res.stderr}


def test_torch_lists_the_aotc_backend() -> None:
    import torch._dynamo

    assert "aotc" in torch._dynamo.list_backends()
    from torch._dynamo.backends.registry import lookup_backend

    from aotc.backend.serve import aotc_backend

    assert lookup_backend("aotc") is aotc_backend


def test_aotc_backend_is_callable_as_the_issue_writes_it() -> None:
    import aotc

    configured = aotc.backend(store="/nowhere", compile_sizes=[8, 1], tolerance=(1e-3, 1e-2))
    from aotc.backend.serve import AotcBackend  # imported after: aotc.backend stays the function

    again = aotc.backend(compile_sizes="4")
    assert configured.config.compile_sizes == (1, 8) and configured.config.atol == 1e-3
    assert again.config.compile_sizes == (4,) and type(again) is AotcBackend


@pytest.mark.parametrize("kwargs, words", [
    ({"compile_sizes": "8,x"}, "compile sizes must be positive integers"),
    ({"compile_sizes": [0]}, "compile sizes must be positive integers"),
    ({"splitting_ops": ["attention"]}, "'attention' is not an op name"),
    ({"tolerance": "tight"}, "tolerance"),
    ({"tolerance": -1.0}, "must be >= 0"),
    ({"inductor": ["max_autotune"]}, "dict of Inductor config patches"),
])
def test_bad_backend_arguments_are_named(kwargs: dict, words: str) -> None:
    import aotc
    from aotc.errors import BackendError

    with pytest.raises(BackendError, match=words):
        aotc.backend(**kwargs)


def test_unknown_torch_compile_options_are_named() -> None:
    from aotc.backend.serve import aotc_backend
    from aotc.errors import BackendError

    with pytest.raises(BackendError, match="aotc.backend's arguments"):
        aotc_backend(None, [], options={"stor": "/tmp/x"})


def test_defaults_come_from_the_settings() -> None:
    from aotc.backend.config import DEFAULT_INDUCTOR, DEFAULT_SPLITTING_OPS, BackendConfig
    from aotc.errors import BackendError
    from aotc.settings import Settings

    cfg = BackendConfig.make()
    env = Settings.from_env({"AOTC_COMPILE_SIZES": "8, 1,4", "AOTC_SPLITTING_OPS": "my::attn"})
    assert cfg.sizes(env) == (1, 4, 8) and cfg.ops(env) == ("my::attn",)
    assert cfg.sizes(Settings()) == () and cfg.ops(Settings()) == DEFAULT_SPLITTING_OPS
    assert "vllm::unified_attention_with_output" in DEFAULT_SPLITTING_OPS
    assert "vllm::unified_kv_cache_update" in DEFAULT_SPLITTING_OPS
    assert cfg.tolerance_for(torch.bfloat16) == (3e-2, 3e-2)
    assert cfg.inductor == DEFAULT_INDUCTOR  # Inductor's defaults (no header): the thread count is keyed
    assert BackendConfig.make(inductor={}).inductor == {}
    with pytest.raises(BackendError, match="AOTC_COMPILE_SIZES"):
        cfg.sizes(Settings.from_env({"AOTC_COMPILE_SIZES": "big"}))


def test_an_unstable_constant_is_refused_not_guessed() -> None:
    from aotc.backend.graphkey import graph_factors
    from aotc.errors import BackendError

    g = torch.fx.Graph()
    x = g.placeholder("x")
    add = g.call_function(torch.add, (x, 1.0))
    g.output(add)
    gm = torch.fx.GraphModule(torch.nn.Module(), g)
    add.args = (x, object())  # an object whose repr is its address
    with pytest.raises(BackendError, match="no stable spelling"):
        graph_factors(gm, [torch.ones(2)])


def test_placeholder_names_and_symbols_do_not_change_the_key() -> None:
    from aotc.backend.graphkey import graph_factors

    def graph(name: str) -> torch.fx.GraphModule:
        g = torch.fx.Graph()
        a, b = g.placeholder(name), g.placeholder(name + "_w")
        g.output((g.call_function(torch.matmul, (a, b)),))
        return torch.fx.GraphModule(torch.nn.Module(), g)

    w = torch.ones(4, 4)
    f1 = graph_factors(graph("l_self_modules_layers_0"), [torch.ones(3, 4), w])
    f2 = graph_factors(graph("other"), [torch.ones(3, 4), w])
    f3 = graph_factors(graph("other"), [torch.ones(3, 5), torch.ones(5, 4)])
    assert f1 == f2 and f1["nodes"] == f3["nodes"] and f1["inputs"] != f3["inputs"]


@pytest.mark.slow
def test_the_key_is_the_same_in_fresh_processes_and_directories(tmp_path: Path) -> None:
    """Two fresh processes, different working directories, temp dirs, hash seeds and home
    directories (another machine with the same toolchain) key the graph alike; a wider model
    keys differently."""
    env = python_env()
    keys = []
    for i in range(2):
        d = tmp_path / f"machine{i}"
        (d / "tmp").mkdir(parents=True)
        e = {**env, "TMPDIR": str(d / "tmp"), "HOME": str(d), "PYTHONHASHSEED": str(100 + i),
             "AOTC_STORE": str(d / "store")}
        keys.append(_run("toy", e, "key-only", cwd=d)["keys"])
    wide = _run("toy-wide", {**env, "AOTC_STORE": str(tmp_path / "s")}, "key-only")["keys"]
    assert len(keys[0]) == 1 and keys[0] == keys[1]
    assert wide[0] != keys[0][0]


@pytest.mark.slow
@pytest.mark.parametrize("what", ["toy", "hf"])
def test_a_second_fresh_process_compiles_nothing_and_matches_eager(
        what: str, tmp_path: Path, compiled) -> None:
    tmp, _store, _results = compiled
    model = "toy" if what == "toy" else str(tmp / "hf-model")  # written by the session fixture
    env = {**python_env(), "AOTC_STORE": str(tmp_path / "store"), "AOTC_LOG": "info",
           "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "inductor-cold")}
    cold = _run(model, env)
    assert max(cold["errors"].values()) < 1e-3, cold["errors"]
    assert cold["counters"]["compiles"] > 0 and "miss: compiled" in cold["stderr"]
    warm_dir = tmp_path / "inductor-warm"
    warm = _run(model, {**env, "TORCHINDUCTOR_CACHE_DIR": str(warm_dir)})
    assert max(warm["errors"].values()) < 1e-3, warm["errors"]
    c = warm["counters"]
    assert c["compiles"] == 0 and c["inductor_compiles"] == 0, c
    assert c["cache_hits"] >= 1 and c["fast_loads"] == c["loads"] > 0, c
    assert "miss" not in warm["stderr"] and "hit: loaded from the store" in warm["stderr"]
    kernels = [p for p in warm_dir.rglob("*") if p.is_file() and p.suffix in (".so", ".cpp", ".py")]
    assert kernels == [], kernels[:5]
    # the store commands see the backend's entries like any other
    listed = json.loads(run_cli("inspect", "cache", "--json", env=env, check=True).stdout)
    assert {e["name"] for e in listed["entries"]} == {"torch.compile"} and len(listed["entries"]) >= 1
    run_cli("verify", env=env, check=True)


def test_a_bad_vllm_manifest_names_the_field(tmp_path: Path) -> None:
    (tmp_path / "m.yaml").write_text("name: x\nvllm:\n  model: nowhere\n")
    res = run_cli("compile", str(tmp_path / "m.yaml"), env={**python_env(), "AOTC_STORE": str(tmp_path / "s")})
    assert res.returncode != 0 and "vllm.model" in res.stderr and "config.json" in res.stderr
    assert len(res.stderr.strip().splitlines()) == 1
    (tmp_path / "m.yaml").write_text("name: x\nvllm:\n  model: .\n  max_model_len: -3\n")
    (tmp_path / "config.json").write_text("{}")
    res = run_cli("compile", str(tmp_path / "m.yaml"), env={**python_env(), "AOTC_STORE": str(tmp_path / "s")})
    assert "vllm.max_model_len: must be a positive integer" in res.stderr


@pytest.mark.slow  # its fallback is an Inductor compile
def test_a_miss_under_a_trust_policy_refuses_before_compiling(tmp_path: Path, caplog,
                                                               monkeypatch) -> None:
    """An entry compiled here would be unsigned, so the policy would refuse it after minutes of
    compiling: the backend says so at once, compiling nothing of its own — raising under
    ``fallback="error"``, else Inductor serves the graph with one warning line naming why. With
    ``AOTC_SIGNING_KEY`` naming a trusted key it compiles, signs and serves."""
    import aotc
    from aotc.counters import COUNTERS
    from aotc.errors import TrustError
    from aotc.fleet.trust import generate_key

    public = generate_key(tmp_path / "signer")
    fn = torch.compile(lambda x: torch.relu(x) * 2,
                       backend=aotc.backend(store=str(tmp_path / "store"), trust=[public],
                                            fallback="error"))
    before = COUNTERS.compiles
    with pytest.raises(Exception) as e:
        fn(torch.ones(3))
    assert isinstance(e.value.__cause__ or e.value, TrustError) or "trust policy" in str(e.value)
    assert COUNTERS.compiles == before
    torch._dynamo.reset()
    caplog.clear()
    served = torch.compile(lambda x: torch.relu(x) * 3,
                           backend=aotc.backend(store=str(tmp_path / "store"), trust=[public]))
    assert torch.equal(served(torch.tensor([-1.0, 2.0])), torch.tensor([0.0, 6.0]))
    lines = aotc_warnings(caplog)
    assert len(lines) == 1 and "TrustError" in lines[0] and "inductor runs it instead" in lines[0]
    assert COUNTERS.compiles == before
    # AOTC_SIGNING_KEY of a trusted key: this process signs what it compiles, so it may compile
    torch._dynamo.reset()
    monkeypatch.setenv("AOTC_SIGNING_KEY", str(tmp_path / "signer"))
    signed = torch.compile(lambda x: torch.relu(x) * 4,
                           backend=aotc.backend(store=str(tmp_path / "store"), trust=[public],
                                                fallback="error"))
    assert torch.equal(signed(torch.tensor([-1.0, 2.0])), torch.tensor([0.0, 8.0]))
    torch._dynamo.reset()
    from aotc.cache import Store

    (key,) = Store(tmp_path / "store").keys()
    assert public in Store(tmp_path / "store").signatures(key)


def test_the_saved_record_names_an_absolute_store_and_loads_lazily(tmp_path: Path,
                                                                    monkeypatch) -> None:
    from aotc.backend.compiled import AotcCompiled
    from aotc.cache import Store

    monkeypatch.chdir(tmp_path)
    f = AotcCompiled("ab" * 32, store=Store(tmp_path / "s"))
    g = AotcCompiled.deserialize_compile_artifacts(AotcCompiled.serialize_compile_artifacts(f))
    assert g.store == str((tmp_path / "s").resolve())
    assert g.runner is None and len(AotcCompiled.serialize_compile_artifacts(f)) < 300
    assert AotcCompiled("cd" * 32, store="rel").store == str((tmp_path / "rel").resolve())
    assert AotcCompiled("cd" * 32, store="oci://127.0.0.1:5000/ml/aotc").store == "oci://127.0.0.1:5000/ml/aotc"


def test_a_saved_record_never_widens_trust_or_redirects_pulls(tmp_path: Path, monkeypatch) -> None:
    """Trust hole 7: a record (what vLLM keeps in its AOT file) that names a remote and trusted
    keys is data: loading it asks only the operator's store, remote and policy."""
    import json

    from aotc.backend.compiled import AotcCompiled
    from aotc.cache import CacheMiss, Store

    for var in ("AOTC_REMOTE", "AOTC_TRUST_KEYS", "AOTC_ALLOW_UNSIGNED", "AOTC_STORE"):
        monkeypatch.delenv(var, raising=False)
    Store(tmp_path / "s", create=True)
    record = json.dumps({"aotc": 1, "key": "ab" * 32, "store": str(tmp_path / "s"),
                         "remote": "s3://attacker-bucket/p", "trust": ["cd" * 32]}).encode()
    g = AotcCompiled.deserialize_compile_artifacts(record)
    assert b"attacker" not in AotcCompiled.serialize_compile_artifacts(g)
    with pytest.raises(CacheMiss) as miss:  # not a pull from the record's remote
        g.finalize_loading()
    assert "attacker" not in str(miss.value)


def test_a_mode_asking_for_cuda_graphs_compiles_a_cpu_graph_as_inductor_does() -> None:
    """``reduce-overhead`` on CPU, static shapes: Inductor's CUDA-graph setting on (it captures
    nothing off CUDA); dynamic shapes, CUDA (aotc captures its own) or no mode: untouched."""
    from aotc.backend.config import BackendConfig

    ro = BackendConfig.make(mode="reduce-overhead")
    assert ro.graphs and "triton.cudagraphs" not in ro.inductor
    assert ro.on_device("cpu", static=True).inductor["triton.cudagraphs"] is True
    assert ro.on_device("cpu", static=False) is ro  # Dynamo guards no stride of a dynamic input
    assert ro.on_device("cuda:0", static=True) is ro
    plain = BackendConfig.make()
    assert plain.on_device("cpu", static=True) is plain


def _wrapper_sources(store: Path, key: str) -> list[str]:
    from aotc.cache import Store
    from aotc.records.program import PROGRAM_ROLE, Program
    from aotc._torch.wrapper import WrapperCode

    s = Store(store)
    entry = s.get(key, record=False)
    program = Program.from_json(s.read_blob(entry, PROGRAM_ROLE))
    return [WrapperCode.from_json(s.read_blob(entry, a.wrapper_role)).source
            for a in program.artifacts if a.wrapper_role]


@pytest.mark.slow
def test_reduce_overhead_on_cpu_runs_without_per_call_input_asserts(tmp_path: Path) -> None:
    """A CPU graph compiled under ``mode="reduce-overhead"`` is keyed apart from the default
    mode, runs through the fast path and gives eager's results, and its pieces no longer assert
    each input's layout per call (as Inductor's own code in that mode), where the default mode's do."""
    import aotc

    class Net(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b = torch.nn.Linear(16, 16), torch.nn.Linear(16, 16)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = torch.relu(self.a(x))
            q = h.view(1, 2, -1, 8)
            h = torch.nn.functional.scaled_dot_product_attention(q, q, q).view(-1, 16)
            return self.b(h) + x

    torch.manual_seed(0)
    net, x = Net().eval(), torch.randn(5, 16)
    keys, sources = {}, {}
    for mode in ("default", "reduce-overhead"):
        be = aotc.backend(store=str(tmp_path / "store"), fallback="error")
        torch._dynamo.reset()
        with torch.no_grad():
            got = torch.compile(net, backend=be, mode=mode)(x)
            assert torch.allclose(got, net(x), atol=1e-5)
        keys[mode] = be.last["key"]
        sources[mode] = _wrapper_sources(tmp_path / "store", keys[mode])
    assert keys["default"] != keys["reduce-overhead"]
    assert gc.isenabled()  # the compile paused the collector (aotc.gc_pause) and gave it back
    assert sources["default"] and sources["reduce-overhead"]
    assert any("'input')" in s for s in sources["default"])
    assert not any("'input')" in s for s in sources["reduce-overhead"])


def test_dynamic_threads_set_in_the_environment_after_import_is_a_patch() -> None:
    """vLLM's CPU platform sets TORCHINDUCTOR_CPP_DYNAMIC_THREADS=1 in its engine process after
    Inductor read its config: the backend takes it as a patch at each call (the engine's process
    and its spawned workers then compile under one key); a given patch wins; unset, nothing."""
    from aotc.backend.config import BackendConfig

    plain = BackendConfig.make()
    assert plain.with_env({}) is plain
    assert plain.with_env({"TORCHINDUCTOR_CPP_DYNAMIC_THREADS": "1"}).inductor == {**plain.inductor,
                                                                                  "cpp.dynamic_threads": True}
    assert plain.with_env({"TORCHINDUCTOR_CPP_DYNAMIC_THREADS": "0"}).inductor == {**plain.inductor,
                                                                                  "cpp.dynamic_threads": False}
    given = BackendConfig.make(inductor={"cpp.dynamic_threads": False})
    assert given.with_env({"TORCHINDUCTOR_CPP_DYNAMIC_THREADS": "1"}) is given
