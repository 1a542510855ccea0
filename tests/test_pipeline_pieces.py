"""Capture → split → compile/save/load of pieces, on the toy Llama (real Dynamo + Inductor).

Compiles are shared through module-scoped fixtures; the fresh-process check runs a real
subprocess. Tiny model: 2 layers, hidden 64, 4 heads, vocab 128.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from aotc._torch import regions
from aotc.compile.capture import ArgSlot, capture, graph_args
from aotc.errors import CaptureError
from aotc.models import toy_llama
from aotc.compile.split import split

TINY = dict(layers=2, hidden=64, heads=4, vocab=128)
REPO = Path(__file__).resolve().parents[1]


def _inputs(n: int, seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, TINY["vocab"], (n,), generator=g), torch.arange(n)]


@pytest.fixture(scope="module")
def model() -> torch.nn.Module:
    return toy_llama.build(**TINY)


@pytest.fixture(scope="module")
def captured(model):
    return capture(model, _inputs(7), [0, 0])


@pytest.fixture(scope="module")
def pieces(captured):
    return split(captured.gm, ["aotc::attention"])


# ---------------------------------------------------------------- the model and its custom op


def test_custom_op_matches_reference():
    g = torch.Generator().manual_seed(1)
    q, k, v = torch.randn(3, 9, 4, 16, generator=g).unbind(0)
    out = torch.ops.aotc.attention(q, k, v)
    assert out.shape == (9, 4, 16)
    torch.testing.assert_close(out, toy_llama.reference_attention(q, k, v), rtol=1e-5, atol=1e-5)
    torch.library.opcheck(torch.ops.aotc.attention.default, (q, k, v))


def test_custom_op_registration_is_idempotent():
    import importlib

    importlib.reload(toy_llama)
    assert toy_llama.attention is torch.ops.aotc.attention


def test_build_is_deterministic(model):
    again = toy_llama.build(**TINY)
    assert len(model.state_dict()) == len(again.state_dict()) > 0
    for (n1, p1), (n2, p2) in zip(model.state_dict().items(), again.state_dict().items()):
        assert n1 == n2 and torch.equal(p1, p2)
    assert model(*_inputs(5)).shape == (5, TINY["vocab"])


# ---------------------------------------------------------------- capture


def test_capture_arg_spec_covers_params_and_inputs(model, captured):
    spec = captured.arg_spec
    placeholders = [n for n in captured.gm.graph.nodes if n.op == "placeholder"]
    assert len(spec) == len(placeholders)
    params = {s.fqn for s in spec if s.kind == "param"}
    assert params == {n for n, _ in model.named_parameters()}
    assert {s.fqn for s in spec if s.kind == "buffer"} == {"rotary.inv_freq"}
    assert sorted(s.index for s in spec if s.kind == "input") == [0, 1]
    syms = [s for s in spec if s.kind == "symbol"]
    assert syms and all(s.source == "input 0 dim 0" and s.dim == 0 for s in syms)
    assert all(isinstance(s, ArgSlot) for s in spec)


def test_capture_source_files_and_dynamic(captured):
    files = dict(captured.source_files)
    assert "aotc/models/toy_llama.py" in files
    assert len(files["aotc/models/toy_llama.py"]) == 64
    assert not any(f.startswith("torch/") for f in files)
    from aotc._torch.dynamo import supports_shape_id

    assert captured.dynamic == ("unbacked" if supports_shape_id() else "backed")
    assert captured.token_range is not None and captured.token_range[1] is None


@pytest.mark.parametrize("n", [1, 2, 13])
def test_captured_graph_runs_any_size_without_dynamo(model, captured, n):
    args = graph_args(captured.arg_spec, model, _inputs(n))
    with torch.no_grad():
        (out,) = captured.gm(*args)
        ref = model(*_inputs(n))
    torch.testing.assert_close(out, ref)


def test_capture_graph_break_names_file_and_line():
    class Breaks(torch.nn.Module):
        def forward(self, x):
            y = x * 2
            print("side effect")  # graph break
            return y

    with pytest.raises(CaptureError, match=r"test_pipeline_pieces\.py:\d+"):
        capture(Breaks(), [torch.randn(3, 4)], [0])


# ---------------------------------------------------------------- split


def test_split_two_layers(model, captured, pieces):
    assert len(pieces.pieces) == 5 and not pieces.warnings
    assert [p.is_splitting for p in pieces.pieces] == [False, True, False, True, False]
    with torch.no_grad():
        (out,) = pieces.stitch(*graph_args(captured.arg_spec, model, _inputs(6)))
    torch.testing.assert_close(out, model(*_inputs(6)))


@pytest.fixture(scope="module")
def four_layers():
    m4 = toy_llama.build(**{**TINY, "layers": 4})
    return split(capture(m4, _inputs(7), [0, 0]).gm, ["aotc::attention"])


@pytest.mark.parametrize("torch_key_api", [True, False], ids=["inductor-key", "fallback-key"])
def test_split_four_layers_and_dedup_keys(four_layers, torch_key_api, monkeypatch):
    from aotc._torch import inductor_compile
    from aotc._torch.inductor_compile import piece_cache_key

    if not torch_key_api:  # as on a torch without standalone_compile.autograd_cache_key
        monkeypatch.setattr(inductor_compile, "_sc_module", lambda: object())
    r4 = four_layers
    assert len(r4.pieces) == 9
    key = {i: piece_cache_key(p.gm, p.example_inputs, True) for i, p in enumerate(r4.pieces)}
    assert key[1] == key[3] == key[5] == key[7]  # attention of every layer
    assert key[2] == key[4] == key[6]  # layer i post-attention + layer i+1 pre-attention
    assert len({key[0], key[1], key[2], key[8]}) == 4
    p = r4.pieces[2]
    static = {n: piece_cache_key(p.gm, p.example_inputs, False, size=n) for n in (4, 8)}
    assert static[4] != static[8] and key[2] not in static.values()
    assert static[4] == piece_cache_key(p.gm, p.example_inputs, False, size=4)
    assert piece_cache_key(p.gm, p.example_inputs, True, options={"cpp.simdlen": 256}) != key[2]


def test_split_without_splitting_op_warns(captured):
    res = split(captured.gm, ["aten::scaled_dot_product_attention"])
    assert len(res.pieces) == 1 and res.warnings


def test_split_example_inputs_are_symbolic(pieces):
    mid = pieces.pieces[2]
    shapes = [tuple(v.shape) for v in mid.example_inputs if isinstance(v, torch.Tensor)]
    assert any(isinstance(s, torch.SymInt) for shape in shapes for s in shape)


# ---------------------------------------------------------------- compile, save, load


@pytest.fixture(scope="module")
def compiled(pieces, tmp_path_factory):
    from aotc._torch import inductor_compile

    piece = pieces.pieces[2]  # post-attention MLP + next layer's pre-attention: 3 C++ kernels
    out = tmp_path_factory.mktemp("compiled")
    return piece, {
        size: inductor_compile.compile_piece(piece.gm, piece.example_inputs, size, out / f"s{size}", {})
        for size in (None, 5)
    }


def _real_args(piece, n: int, seed: int = 0) -> list:
    from aotc._torch.inductor_compile import static_example_inputs

    g = torch.Generator().manual_seed(seed)
    return [
        torch.randn(a.shape, generator=g, dtype=a.dtype).to(a.device)
        if isinstance(a, torch.Tensor) and a.is_floating_point() else a
        for a in static_example_inputs(piece.example_inputs, n)
    ]


@pytest.mark.slow
@pytest.mark.parametrize("threads", [2, 1], ids=["thread-pool", "no-pool"])
def test_a_pieces_kernels_build_in_one_compiler_run(compiled, tmp_path, threads):
    """The piece's 3 C++ kernels: one g++ run, one library linked at each kernel's path (so a
    load by key finds each), and each path imports as its own kernel: the fast path, recorded
    against Inductor's artifact, reproduces the piece. With Inductor's kernel thread pool and
    without it (``compile_threads`` 1: what importing vLLM sets, as this test session does)."""
    from torch._dynamo.utils import compilation_time_metrics
    from torch._inductor import config

    from aotc._torch import inductor_compile, kernel_pool, wrapper

    piece, _arts = compiled
    runs = len(compilation_time_metrics.get("compile_file", []))
    with config.patch({"compile_threads": threads}):
        c = inductor_compile.compile_piece(piece.gm, piece.example_inputs, 5, tmp_path / "one", {})
    assert len(compilation_time_metrics.get("compile_file", [])) - runs == 1
    libs = [c.kernel_root / r for r in c.kernel_files if kernel_pool.is_kernel(r)]
    assert len(libs) == 3 and c.kernels == {"built": 3, "pooled": 0}
    assert len({p.read_bytes() for p in libs}) == 1  # one library, three names
    assert c.wrapper is not None, c.wrapper_note
    fast = wrapper.load(wrapper.WrapperCode.from_json(c.wrapper.read_bytes()), c.kernel_root)
    args = _real_args(piece, 5)
    with torch.no_grad():
        got, want = fast(*args), piece.gm(*args)
        assert len(got) == len(want) > 0
        for a, b in zip(got, want):
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)


@pytest.mark.slow
def test_the_kernels_of_tasks_in_a_row_build_in_one_compiler_run(compiled, tmp_path, monkeypatch):
    """A worker loop holds the kernels of up to 3 tasks and builds them with one g++ run; a
    kernel two of them hold (two ids of one piece, same size) is built once and linked; each
    task still ships its own kernel files and a fast path that reproduces the piece. (Without
    aotc's header: with it, the batch is built in parts, test_kernel_header.)"""
    from torch._dynamo.utils import compilation_time_metrics
    from torch._inductor import config

    from aotc._torch import kernel_header, kernel_pool, wrapper
    from aotc.compile import workers

    monkeypatch.delitem(kernel_header._state, "machine", raising=False)  # no header for this process

    piece, _arts = compiled
    first_of = {"a": piece, "b": piece}
    tasks = [("a", 4), ("b", 4), ("a", 6)]
    got: dict = {}
    runs = len(compilation_time_metrics.get("compile_file", []))
    with config.patch({"compile_threads": 2}):
        workers.compile_here(first_of, tasks, tmp_path, {}, lambda t, c, *_: got.update({t: c}))
    assert len(compilation_time_metrics.get("compile_file", [])) - runs == 1
    assert [got[t].kernels for t in tasks] == [{"built": 3, "pooled": 0}, {"built": 0, "pooled": 3},
                                               {"built": 3, "pooled": 0}]
    libs = {t: [got[t].kernel_root / r for r in got[t].kernel_files if kernel_pool.is_kernel(r)]
            for t in tasks}
    assert [p.name for p in libs[("a", 4)]] == [p.name for p in libs[("b", 4)]]
    assert len({p.read_bytes() for ps in libs.values() for p in ps}) == 1  # one library, 6 names
    for (uid, n) in tasks:
        c = got[(uid, n)]
        assert c.wrapper is not None, c.wrapper_note
        fast = wrapper.load(wrapper.WrapperCode.from_json(c.wrapper.read_bytes()), c.kernel_root)
        args = _real_args(piece, n)
        with torch.no_grad():
            got_n, want_n = fast(*args), piece.gm(*args)
            assert len(got_n) == len(want_n) > 0
            for x, y in zip(got_n, want_n):
                torch.testing.assert_close(x, y, rtol=1e-4, atol=1e-4)


def test_kernel_sources_not_shaped_for_one_unit_are_left_alone():
    from aotc._torch.kernel_batch import combine

    ok = ('#include <a.h>\nextern "C"  void  kernel(float* x) { x[0] = 1; }\n'
          "#define PY_SSIZE_T_CLEAN\n#include <Python.h>\n"
          "#ifdef Py_GIL_DISABLED\n#endif\nPyMODINIT_FUNC PyInit_kernel(void) { return 0; }\n")
    text = combine([("ca.main.so", ok), ("cb.main.so", ok)])
    assert text is not None and text.count("#include <Python.h>") == 1
    assert text.index("#define PY_SSIZE_T_CLEAN") < text.index("#include <Python.h>")
    assert "namespace aotc_k1" in text and 'strcmp(base, "cb.main.so")' in text
    macro = ok.replace("#ifdef", "#define likely(x) (x)\n#ifdef")  # torch 2.11's kernels have one
    assert combine([("a.so", macro), ("b.so", macro)]) is not None  # the same in each: kept
    assert combine([("a.so", macro), ("b.so", ok)]) is None  # not the same in each: no batch
    assert combine([("a.so", ok + 'extern "C" void kernel(int);')]) is None  # two entry points
    assert combine([("a.so", ok.replace("#endif", "#include <b.h>\n#endif"))]) is None


@pytest.mark.slow
def test_kernel_pool_builds_a_shared_kernel_once_and_ships_only_the_ones_used(compiled, pieces, tmp_path):
    """A kernel already in the job's pool is not built again; a piece's kernel files are the
    libraries it uses, not everything the pool holds; what it built joins the pool."""
    from aotc._torch import inductor_compile, inductor_load, kernel_pool

    piece, arts = compiled
    pool = tmp_path / "pool"
    mine = {r for r in arts[None].kernel_files if kernel_pool.is_kernel(r)}  # not the ISA probes
    assert kernel_pool.add(pool, arts[None].kernel_root, sorted(mine)) == len(mine) > 0
    again = inductor_compile.compile_piece(piece.gm, piece.example_inputs, None, tmp_path / "again",
                                           {}, pool=pool)
    assert again.kernels == {"built": 0, "pooled": len(mine)}
    assert set(filter(kernel_pool.is_kernel, again.kernel_files)) == mine and again.wrapper is not None
    other = pieces.pieces[0]  # embedding + the first pre-attention: none of the MLP's kernels
    c = inductor_compile.compile_piece(other.gm, other.example_inputs, None, tmp_path / "other", {},
                                       pool=pool)
    taken = set(c.kernel_files) & mine
    assert c.kernels["pooled"] == len(taken) and taken != mine
    assert c.kernels["built"] > 0
    assert all((pool / r).is_file() for r in filter(kernel_pool.is_kernel, c.kernel_files))
    root = tmp_path / "root"  # its own kernel files are all a load needs
    shutil.copytree(c.kernel_root, root)
    args = _real_args(other, 4)
    with torch.no_grad():
        ref = other.gm(*args)
        out = inductor_load.load_piece(c.artifact, root)(*args)
    assert len(out) == len(ref) > 0
    for a, b in zip(out, ref):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)


@pytest.mark.slow
@pytest.mark.parametrize("size,n", [(None, 5), (None, 1), (5, 5)])
def test_compile_save_load_reproduces_piece(compiled, tmp_path, size, n):
    from aotc._torch import inductor_load

    piece, arts = compiled
    cp = arts[size]
    assert cp.artifact.is_file() and cp.kernel_files
    assert any(f.endswith(".so") for f in cp.kernel_files)
    root = tmp_path / "kernels"
    shutil.copytree(cp.kernel_root, root)
    fn = inductor_load.load_piece(cp.artifact, root)
    args = _real_args(piece, n)
    with torch.no_grad():
        ref = piece.gm(*args)
        out = fn(*args)
    assert isinstance(out, list) and len(out) == len(ref)
    for a, b in zip(out, ref):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)


@pytest.mark.slow
def test_counters_and_factors(compiled):
    from aotc._torch import inductor_facts

    snap = inductor_facts.counters_snapshot()
    assert snap["compiles"] >= 2 and snap["inductor_compiles"] >= 2
    f = inductor_facts.toolchain_factors("cpu")
    assert f["torch"] == torch.__version__ and len(f["torch_key"]) == 64
    assert f["vec_isa"] is None or isinstance(f["vec_isa"], str)
    assert str(REPO) not in json.dumps(f) and os.uname().nodename not in json.dumps(f)


_FRESH = textwrap.dedent(
    """
    import json, sys, time
    from pathlib import Path
    t0 = time.perf_counter()
    import torch
    from aotc._torch import inductor_compile
    from aotc._torch import inductor_facts
    from aotc._torch import inductor_load
    from torch._dynamo.utils import counters
    root = Path(sys.argv[2])
    binaries = ("*.so", "*.cubin", "*.hsaco")
    before = {p for pat in binaries for p in root.rglob(pat)}
    t1 = time.perf_counter()
    fn = inductor_load.load_piece(Path(sys.argv[1]), root)
    t2 = time.perf_counter()
    data = torch.load(sys.argv[3])
    with torch.no_grad():
        out = fn(*data["args"])
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    t3 = time.perf_counter()
    assert len(out) == len(data["ref"]) > 0
    err = max(((a - b).abs() / (1 + b.abs())).max().item() for a, b in zip(out, data["ref"]))
    new = sorted(str(p.relative_to(root)) for pat in binaries for p in root.rglob(pat)
                 if p not in before)
    print(json.dumps({"err": err, "new_binaries": new, "import_s": t1 - t0, "load_s": t2 - t1,
                      "first_call_s": t3 - t2, "counters": inductor_facts.counters_snapshot(),
                      "inductor_counters": dict(counters["inductor"])}))
    """
)


def _fresh_load(piece, cp, tmp_path: Path, n: int, ship_kernels: bool = True) -> dict:
    """Load ``cp`` in a new interpreter (kernel files copied to a fresh root, or not) and run it
    on ``n`` tokens; returns the child's report (error vs the eager piece, timings, counters)."""
    from tests.conftest import python_env

    root = tmp_path / ("kernels" if ship_kernels else "empty")
    if ship_kernels:
        shutil.copytree(cp.kernel_root, root)
    root.mkdir(parents=True, exist_ok=True)
    args = _real_args(piece, n, seed=3)
    with torch.no_grad():
        ref = [t.cpu() for t in piece.gm(*args)]
    io = tmp_path / f"io-{ship_kernels}.pt"
    torch.save({"args": args, "ref": [r.to(args[0].device) for r in ref]}, io)
    res = subprocess.run(
        [sys.executable, "-c", _FRESH, str(cp.artifact), str(root), str(io)],
        capture_output=True, text=True, env=python_env(), timeout=600,
    )
    assert res.returncode == 0, res.stderr[-3000:]
    return json.loads(res.stdout.strip().splitlines()[-1])


@pytest.mark.slow
def test_fresh_process_load_uses_shipped_kernels(compiled, tmp_path):
    """A new interpreter loads the artifact + shipped kernels: no Dynamo, no Inductor compile,
    and no C++ build (a build would leave a new .so in the cache dir)."""
    piece, arts = compiled
    report = _fresh_load(piece, arts[None], tmp_path, 6)
    print("fresh CPU load:", json.dumps(report))
    assert report["err"] < 1e-4
    assert report["new_binaries"] == []
    c = report["counters"]
    assert c["frames_traced"] == 0 and c["graphs_captured"] == 0 and c["inductor_compiles"] == 0
    assert c["fx_graph_cache_hits"] == 1 and c["loads"] == 1


@pytest.mark.cuda
@pytest.mark.slow
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")
def test_cuda_piece_fresh_load(tmp_path):
    """On CUDA: compile a piece (dynamic and one static size), load both in fresh processes,
    with and without the shipped kernel files; report timings (run with -s to see them)."""
    from aotc._torch import inductor_compile
    from aotc._torch import inductor_facts

    model = toy_llama.build(**TINY).cuda()
    cap = capture(model, [t.cuda() for t in _inputs(7)], [0, 0])
    piece = split(cap.gm, ["aotc::attention"]).pieces[2]
    print("cuda factors:", json.dumps(inductor_facts.toolchain_factors("cuda")))
    for size, n in ((None, 6), (8, 8)):
        cp = inductor_compile.compile_piece(piece.gm, piece.example_inputs, size, tmp_path / f"c{size}", {})
        print(f"cuda compile size={size}: {cp.seconds:.1f}s, kernel files: {list(cp.kernel_files)}")
        for ship in (True, False):
            rep = _fresh_load(piece, cp, tmp_path / f"l{size}{ship}", n, ship_kernels=ship)
            print(f"cuda fresh load size={size} ship={ship}:", json.dumps(rep))
            assert rep["err"] < 1e-3
            assert rep["counters"]["inductor_compiles"] == 0
            assert rep["counters"]["frames_traced"] == 0


@pytest.mark.slow
@pytest.mark.parametrize("size,n", [(None, 5), (None, 1), (None, 17), (5, 5)])
def test_fast_path_is_bitwise_inductors_artifact(compiled, tmp_path, size, n):
    """The fast path (aotc._torch.wrapper) runs the same kernels as CompiledArtifact.load: identical
    outputs, bit for bit, at the compiled size and at sizes it was not checked at."""
    from aotc._torch import inductor_load
    from aotc._torch import wrapper

    piece, arts = compiled
    cp = arts[size]
    assert cp.wrapper is not None, cp.wrapper_note
    code = wrapper.WrapperCode.from_json(cp.wrapper.read_bytes())
    assert code.kernels and set(code.kernels.values()) <= set(cp.kernel_files)
    root = tmp_path / "kernels"
    shutil.copytree(cp.kernel_root, root)
    fast = wrapper.load(code, root)
    slow = inductor_load.load_piece(cp.artifact, root)
    args = _real_args(piece, n, seed=3)
    with torch.no_grad():
        got, want = fast(*args), slow(*args)
    assert wrapper.same_outputs(got, want)


def test_isa_probes_run_in_this_process_and_leave_its_own_probing_as_it_was(tmp_path: Path) -> None:
    """The ISA-extension probe libraries are built in-process into the given dir (not in a child
    interpreter), and Inductor's memo is restored: the process still picks the ISA it picked."""
    from torch._inductor import config
    from torch._inductor.cpu_vec_isa import pick_vec_isa

    from aotc._torch import isa_probes
    from aotc._torch.inductor_load import kernel_files

    with config.patch({"cpp.vec_isa_ok": True}):  # as aotc compiles (no base-ISA test builds)
        before = str(pick_vec_isa())
    assert isa_probes._probe_here(tmp_path) is True  # torch 2.11-2.13 layout
    built = kernel_files(tmp_path)
    assert all(rel.endswith((".so", ".cpp")) for rel in built)
    if torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_vnni_supported():
        assert any(rel.endswith(".so") for rel in built), built  # the extension checks compiled
    with config.patch({"cpp.vec_isa_ok": True}):
        assert str(pick_vec_isa()) == before
    where = isa_probes.machine_isa_probe_dir("ab" * 32)
    assert where.name == "ab" * 16 and where.parent.name == "aotc-isa-probes"


_HEADER_SCRIPT = """
import sys
from pathlib import Path
import torch
from torch._inductor.runtime.cache_dir_utils import default_cache_dir
from aotc._torch import header_build, inductor_compile

headers = Path(default_cache_dir()) / "precompiled_headers"
assert not headers.exists(), headers  # a cold machine
thread = header_build.start_header_build({})  # the ISA predicted: builds beside the probes
assert thread is not None
thread.join()
first = sorted(p.name for p in headers.glob("*.gch"))
gm = torch.fx.symbolic_trace(lambda x: (torch.sigmoid(x) * 2.0 + 1.0,))
inductor_compile.compile_piece(gm, [torch.randn(64)], 64, Path(sys.argv[1]))
import json
print(json.dumps([first, sorted(p.name for p in headers.glob("*.gch"))]))
"""


@pytest.mark.slow
def test_header_built_in_the_background_is_the_one_the_kernels_use(tmp_path: Path) -> None:
    """``start_header_build`` precompiles the very header a CPU kernel's build then includes: on
    a cold machine (empty temp dir) the compile that follows builds no second one — so the ISA
    it predicted before the probes ran was the one they found (else two headers)."""
    env = {**os.environ, "TMPDIR": str(tmp_path / "tmp"), "PYTHONPATH": str(REPO)}
    (tmp_path / "tmp").mkdir()
    out = subprocess.run([sys.executable, "-c", _HEADER_SCRIPT, str(tmp_path / "piece")], env=env,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    first, after = json.loads(out.stdout.strip().splitlines()[-1])
    assert len(first) == 1 and after == first


def test_identical_layers_are_keyed_by_inductor_once(tmp_path: Path, monkeypatch) -> None:
    """Inductor's key of a piece is an AOTAutograd trace: the split computes it once per
    structure (4 layers: first, middle, last), and each piece's own key agrees with the one it
    was given."""
    from aotc._torch import inductor_compile
    from aotc.compile import pieces
    from aotc.manifest import load_manifest
    from tests.conftest import toy_manifest

    calls: list[int] = []
    real = inductor_compile.piece_cache_key
    monkeypatch.setattr(inductor_compile, "piece_cache_key",
                        lambda *a, **k: calls.append(1) or real(*a, **k))
    traced = pieces.trace_and_split(load_manifest(toy_manifest(tmp_path, 4)))
    assert len(traced.uid_of) == 5 and len(traced.first_of) == 3
    assert len(calls) == 3
    for p in traced.parts.pieces:
        if not p.is_splitting:
            assert pieces.piece_uid(p, {}) == traced.uid_of[p.name]


_GLOBAL_BETWEEN_LAYERS = '''
import torch
from torch import nn
from aotc.models.toy_llama import attention

SCALE = 1.0


class Layer(nn.Module):
    def __init__(self, hidden):
        super().__init__()
        self.w = nn.Parameter(torch.randn(hidden))

    def forward(self, x):
        q = (x * self.w * SCALE).view(x.shape[0], 2, -1)
        return x + attention(q, q, q).reshape(x.shape)


class Net(nn.Module):
    def __init__(self, layers, hidden, vocab):
        super().__init__()
        self.embed = nn.Embedding(vocab, hidden)
        self.layers = nn.ModuleList(Layer(hidden) for _ in range(layers))

    def forward(self, input_ids, positions):
        global SCALE
        x = self.embed(input_ids)
        for i, layer in enumerate(self.layers):
            SCALE = 1.0 if i < 2 else 3.0  # the model changes a global its layers read
            x = layer(x)
        SCALE = 1.0
        return x


def build(layers=5, hidden=8, vocab=64):
    torch.manual_seed(0)
    return Net(layers, hidden, vocab).eval()
'''


@pytest.mark.slow
@pytest.mark.skipif(not regions.supported(),
                    reason="needs torch 2.12+ (region reuse): this torch stamps nothing out")
def test_a_failed_check_with_layers_stamped_out_traces_every_layer_under_the_same_key(tmp_path: Path,
                                                                                      monkeypatch) -> None:
    """What the stamp-out's own checks do not see — here a global the model changes between
    layers, with the check that sees it blinded (as a torch that keeps its record otherwise
    would leave a case unseen) — fails the numeric check, and the compile traces every layer
    again before anything is stored: one entry, under the key a lookup computes."""
    import importlib.util

    import yaml

    import aotc
    from aotc._torch import layer_calls
    from aotc.compile.pipeline import compile_manifest

    monkeypatch.setattr(layer_calls, "_changed_state", lambda: ())  # nothing changed, as far as it sees

    (tmp_path / "globalnet.py").write_text(_GLOBAL_BETWEEN_LAYERS)
    manifest = tmp_path / "globalnet.yaml"
    manifest.write_text(yaml.safe_dump({
        "name": "globalnet", "model": {"factory": "globalnet.py:build"},
        "inputs": [{"name": "input_ids", "dtype": "int64", "shape": ["tokens"], "high": 64},
                   {"name": "positions", "dtype": "int64", "shape": ["tokens"], "fill": "arange"}],
        "compile_sizes": [], "max_tokens": 64, "splitting_ops": ["aotc::attention"]}))
    store = tmp_path / "store"
    result = compile_manifest(manifest, store=str(store))
    assert not result.hit and "numeric check failed with layers stamped out" in result.regions, result.regions
    again = compile_manifest(manifest, store=str(store))
    assert again.hit and again.key == result.key
    spec = importlib.util.spec_from_file_location("globalnet_eager", tmp_path / "globalnet.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    eager = module.build()
    runner = aotc.load(manifest, store=str(store), model=eager)
    ids, positions = torch.randint(0, 64, (9,)), torch.arange(9)
    with torch.no_grad():
        torch.testing.assert_close(runner(ids, positions), eager(ids, positions))
