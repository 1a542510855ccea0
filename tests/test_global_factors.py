"""The key's ``global`` group follows torch's own: every field Inductor's FX graph cache hashes
(``FxGraphHashDetails.__init__``'s ``self.X = …``) is read by aotc, keyed in another group, or
denied with a reason — a field torch adds fails this test until it is one of those; the values
aotc reads equal torch's; and a changed setting is named by ``explain``."""

from __future__ import annotations

import ast
import inspect
import os
import textwrap

import pytest
import torch

from aotc._torch import global_factors as gf
from aotc.records.key import explain


def _fields_in_source() -> set[str]:
    """Every attribute ``FxGraphHashDetails.__init__`` may set, conditional ones included."""
    from torch._inductor.codecache import FxGraphHashDetails

    tree = ast.parse(textwrap.dedent(inspect.getsource(FxGraphHashDetails.__init__)))
    return {t.attr for node in ast.walk(tree) if isinstance(node, (ast.Assign, ast.AnnAssign))
            for t in (node.targets if isinstance(node, ast.Assign) else [node.target])
            if isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name) and t.value.id == "self"}


def test_every_field_torch_hashes_is_read_keyed_elsewhere_or_denied() -> None:
    fields = _fields_in_source()
    assert len(fields) > 10  # the parse sees the fields
    unaccounted = fields - set(gf.READERS) - set(gf.KEYED_ELSEWHERE) - set(gf.DENIED)
    assert unaccounted == set(), f"FxGraphHashDetails fields aotc neither keys nor denies: {sorted(unaccounted)}"


@pytest.mark.skipif(tuple(int(p) for p in torch.__version__.split(".")[:2]) != (2, 13),
                    reason="the tables are written against torch 2.13; older torches set fewer fields")
def test_every_reason_names_a_field_torch_has() -> None:
    """No stale entries: each field aotc reads or denies is still one torch 2.13 sets."""
    stale = (set(gf.READERS) | set(gf.DENIED)) - _fields_in_source()
    assert stale == set()


def _torch_values() -> dict[str, object]:
    from torch._inductor.codecache import FxGraphHashDetails

    return vars(FxGraphHashDetails(None, [], {}, []))


@pytest.mark.parametrize("change", ["default", "medium", "tf32", "deterministic", "reductions"])
def test_aotcs_readers_see_what_torch_hashes(change: str) -> None:
    """Each field read without Inductor holds the values torch's own key holds, in each state."""
    saved = (torch.backends.cuda.matmul.fp32_precision, torch.backends.mkldnn.matmul.fp32_precision,
             torch.are_deterministic_algorithms_enabled(),
             torch.backends.cuda.matmul.allow_fp16_reduced_precision_reduction)
    try:
        if change == "medium":
            torch.set_float32_matmul_precision("medium")
        elif change == "tf32":
            torch.backends.cuda.matmul.fp32_precision = "tf32"
        elif change == "deterministic":
            torch.use_deterministic_algorithms(True)
        elif change == "reductions":
            torch.backends.cuda.matmul.allow_fp16_reduced_precision_reduction = False
        theirs = _torch_values()
        ours = gf.global_factors(gf.hash_detail_fields())
        assert list(ours["deterministic_algorithms_settings"].values()) == list(theirs["deterministic_algorithms_settings"])
        m = ours["cuda_matmul_settings"]
        raw = theirs["cuda_matmul_settings"]
        # torch's raw "none" (inherit) under an IEEE root is spelled "ieee": the same kernels
        assert (m["torch.backends.cuda.matmul.fp32_precision"],
                m["torch.backends.cuda.matmul.allow_fp16_reduced_precision_reduction"],
                m["torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction"]) == \
            ("ieee" if raw[0] == "none" else raw[0], *raw[1:])
        # keyed on every torch (2.11's details lack it: aotc reads it there all the same)
        assert ours["default_dtype"] == str(theirs.get("default_dtype", torch.get_default_dtype()))
        assert ours["cache_key_tag"] == theirs["cache_key_tag"]
        assert ours["custom_backend_passes"] == [] and ours["custom_backend_codegen_configs"] == {}
    finally:
        torch.backends.cuda.matmul.fp32_precision = saved[0]
        torch.backends.mkldnn.matmul.fp32_precision = saved[1]
        torch.use_deterministic_algorithms(saved[2])
        torch.backends.cuda.matmul.allow_fp16_reduced_precision_reduction = saved[3]


def test_a_field_torch_adds_is_keyed_unasked() -> None:
    """A field aotc has no reader for (here: one pretended new, its reader taken away) is read from
    torch's own object and keyed as it is; a field keyed elsewhere stays out."""
    details = _torch_values()
    readers = dict(gf.READERS)
    try:
        del gf.READERS["cache_key_tag"]
        out = gf.global_factors(gf.hash_detail_fields())
    finally:
        gf.READERS.clear()
        gf.READERS.update(readers)
    assert out["cache_key_tag"] == details["cache_key_tag"]
    assert "torch_version" not in out and "inductor_config" not in out


def test_a_value_with_no_stable_spelling_raises() -> None:
    with pytest.raises(TypeError, match="no stable"):
        gf._canonical(object(), "x")


def test_explain_names_the_setting_that_differs() -> None:
    fields = gf.hash_detail_fields()
    before = gf.global_factors(fields)
    saved = (torch.backends.cuda.matmul.fp32_precision, torch.backends.mkldnn.matmul.fp32_precision)
    try:
        torch.set_float32_matmul_precision("medium")
        after = gf.global_factors(fields)
    finally:
        torch.backends.cuda.matmul.fp32_precision, torch.backends.mkldnn.matmul.fp32_precision = saved
    paths = {d.path for d in explain({"global": before}, {"global": after})}
    assert "global.cuda_matmul_settings.torch.backends.cuda.matmul.fp32_precision" in paths
    assert "global.mkldnn.torch.backends.mkldnn.matmul.fp32_precision" in paths


def test_the_defaults_precision_said_explicitly_keeps_the_key() -> None:
    """``set_float32_matmul_precision("highest")`` (vLLM's workers call it) is the default's
    precision: the same key (a legacy getter that raises in a mixed-API process is never read:
    tests/test_key_soundness.py's "tf32" case mixes the two APIs in a fresh process)."""
    fields = gf.hash_detail_fields()
    before = gf.global_factors(fields)
    saved = (torch.backends.cuda.matmul.fp32_precision, torch.backends.mkldnn.matmul.fp32_precision)
    try:
        torch.set_float32_matmul_precision("highest")
        assert gf.global_factors(fields) == before
        torch.set_float32_matmul_precision("high")
        assert gf.global_factors(fields) != before
    finally:
        torch.backends.cuda.matmul.fp32_precision, torch.backends.mkldnn.matmul.fp32_precision = saved


def test_every_inductor_variable_reaches_the_memo_fingerprint(monkeypatch) -> None:
    """Each TORCHINDUCTOR_* variable Inductor's config reads changes the toolchain memo's
    fingerprint (so the remembered Inductor values are never another setting's), locations
    aside — and those are settings Inductor's own cache ignores or aotc denies."""
    import re

    import torch._inductor.config as config

    from aotc.lookup.toolchain import fingerprint

    names = sorted(set(re.findall(r"TORCHINDUCTOR_[A-Z0-9_]+", inspect.getsource(config))))
    assert len(names) > 20
    base = fingerprint("cpu")
    locations = []
    for name in names:
        with monkeypatch.context() as m:
            m.setenv(name, "1" if os.environ.get(name) != "1" else "0")
            if fingerprint("cpu") == base:
                locations.append(name)
    assert all(n.endswith(("DIR", "PATH")) for n in locations), locations


def test_the_memo_keeps_what_a_fresh_process_reads_whatever_this_one_changed(tmp_path) -> None:
    """A process that changed an Inductor setting in-process keys with it (live values) and
    writes none of its values to the toolchain memo; a build fills them from a fresh interpreter
    (so a warm start that reads the memo, never importing Inductor, keys as a fresh process)."""
    import json
    import subprocess

    import torch._inductor.config as config

    from aotc.lookup.toolchain import fingerprint, machine_factors, remember_fresh_values
    from tests.conftest import PYTHON, python_env

    memo_file = tmp_path / f"{fingerprint('cpu')}.json"
    with config.patch({"epilogue_fusion": not config.epilogue_fusion}):
        mine = machine_factors("cpu", tmp_path)["inductor_values"]
        assert "inductor_values" not in json.loads(memo_file.read_text())
        remember_fresh_values("cpu", tmp_path)
    memo = json.loads(memo_file.read_text())["inductor_values"]
    fresh = json.loads(subprocess.run(
        [PYTHON, "-c", "import json; from aotc._torch.inductor_facts import config_values; "
                       "print(json.dumps(config_values()))"],
        capture_output=True, text=True, env=python_env(), check=True, timeout=120).stdout)
    assert mine["epilogue_fusion"] != fresh["epilogue_fusion"]
    assert memo == fresh


def test_the_field_list_is_read_without_hashing_tritons_source() -> None:
    # on a machine without CUDA torch hashes Triton's source for system_info and then drops it:
    # aotc's details (and its pieces' dedup keys) get torch's very value without that hash
    from torch._inductor.codecache import CacheBase, FxGraphHashDetails

    if torch.cuda.is_available():
        pytest.skip("with CUDA the Triton hash is kept: torch's own get_system runs")
    if gf._system_info_without_triton() is None:
        pytest.skip(f"torch {torch.__version__} lays get_system out otherwise (2.11 imports triton_key "
                    "inside it): torch's own runs, as documented")
    before = CacheBase.get_system.cache_info()
    mine = gf._details()
    after = CacheBase.get_system.cache_info()
    assert (after.hits, after.misses) == (before.hits, before.misses), "torch's get_system was called"
    assert hasattr(CacheBase.get_system, "cache_info"), "torch's CacheBase was left patched"
    theirs = FxGraphHashDetails(None, [], {}, [])
    assert sorted(vars(mine)) == sorted(vars(theirs))
    for name in vars(theirs):
        assert repr(getattr(mine, name)) == repr(getattr(theirs, name)), name


@pytest.mark.slow
def test_a_piece_compile_does_not_hash_tritons_source_either(tmp_path) -> None:
    # standalone_compile keys every piece by AOTAutograd's cache key, which reads torch's system
    # info: on a CPU host torch hashes Triton's source there and drops it (0.3 s of a cold call)
    from torch._inductor.codecache import CacheBase

    from aotc._torch import inductor_compile
    from tests.fixtures.small_graphs import sigmoid_times_three_graph

    if torch.cuda.is_available():
        pytest.skip("with CUDA the Triton hash is kept: torch's own get_system runs")
    if gf._system_info_without_triton() is None:
        pytest.skip(f"torch {torch.__version__} lays get_system out otherwise (2.11 imports triton_key "
                    "inside it): torch's own runs, as documented")
    before = CacheBase.get_system.cache_info()
    piece = inductor_compile.compile_piece(sigmoid_times_three_graph(), [torch.randn(4, 8)], None, tmp_path / "p")
    after = CacheBase.get_system.cache_info()
    assert piece.artifact.is_file()
    assert (after.hits, after.misses) == (before.hits, before.misses), "torch's get_system was called"


def test_the_default_dtype_is_keyed_where_torch_does_not_hash_it() -> None:
    """torch 2.11's FX cache key leaves the default dtype out; its lowerings read it: aotc keys it
    whatever the field list says (``global_factors.ALWAYS``)."""
    fields = [f for f in gf.hash_detail_fields() if f != "default_dtype"]  # as torch 2.11 lists them
    before = gf.global_factors(fields)
    saved = torch.get_default_dtype()
    try:
        torch.set_default_dtype(torch.float64)
        after = gf.global_factors(fields)
    finally:
        torch.set_default_dtype(saved)
    assert before["default_dtype"] == str(saved) and after["default_dtype"] == "torch.float64"
    assert [d.path for d in explain({"global": before}, {"global": after})] == ["global.default_dtype"]
