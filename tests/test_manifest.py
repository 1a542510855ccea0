"""aotc.manifest: valid manifests, defaults, key factors, and a table of bad manifests (no torch)."""

from __future__ import annotations

import copy
import dataclasses
import json
import subprocess
import sys
from pathlib import Path
from typing import Any, Callable

import pytest
import yaml

from aotc.errors import ManifestError
from aotc.manifest import FrozenMap, InputSpec, Manifest, load_manifest, parse_manifest, thaw

ROOT = Path(__file__).resolve().parent.parent
MANIFESTS = ROOT / "manifests"

MINIMAL = {
    "name": "m",
    "model": {"factory": "pkg.mod:build"},
    "inputs": [{"name": "input_ids", "dtype": "int64", "shape": ["tokens"], "high": 10}],
}


def write(tmp_path: Path, text: str, name: str = "model.yaml") -> Path:
    p = tmp_path / name
    p.write_text(text)
    return p


def minimal(**top: Any) -> dict[str, Any]:
    d = copy.deepcopy(MINIMAL)
    d.update(top)
    return d


# ------------------------------------------------------------------ valid manifests


def test_bundled_toy_llama_loads() -> None:
    m = load_manifest(MANIFESTS / "toy-llama.yaml")
    assert m.name == "toy-llama"
    assert m.model.factory == "aotc.models.toy_llama:build"
    assert m.model.factory_module == "aotc.models.toy_llama" and m.model.factory_fn == "build"
    assert m.model.factory_file is None
    assert dict(m.model.kwargs) == {"layers": 2, "hidden": 256, "heads": 4, "vocab": 1024}
    assert [i.name for i in m.inputs] == ["input_ids", "positions"]
    assert m.inputs[0].high == 1024 and m.inputs[0].fill == "random" and m.inputs[0].token_dim == 0
    assert m.inputs[1].fill == "arange" and m.inputs[1].high is None
    assert m.compile_sizes == (1, 2, 4, 8, 16)
    assert m.capture_sizes == (1, 2, 4, 8, 16, 32)
    assert m.splitting_ops == ("aotc::attention",)
    assert m.tolerance.atol == 1e-4 and m.tolerance.rtol == 1e-4
    assert m.path == (MANIFESTS / "toy-llama.yaml").resolve() and m.base_dir == MANIFESTS.resolve()


def test_bundled_tiny_hf_llama_loads() -> None:
    m = load_manifest(str(MANIFESTS / "tiny-hf-llama.yaml"))
    assert m.model.factory is None and m.model.hf is not None
    assert m.model.hf.architecture == "LlamaForCausalLM"
    assert m.model.hf.config["hidden_size"] == 64 and m.model.hf.config["vocab_size"] == 256
    assert m.model.hf.config_path is None
    assert m.model.output == "logits"
    assert [(i.name, i.shape, i.token_dim) for i in m.inputs] == [
        ("input_ids", (1, "tokens"), 1), ("position_ids", (1, "tokens"), 1)]
    assert m.inputs[0].high == 256 and m.inputs[1].fill == "arange"
    assert m.splitting_ops == ("aten::scaled_dot_product_attention",)
    assert m.compile_sizes == (1, 4, 16) and m.capture_sizes == ()


def test_regions_field(tmp_path: Path) -> None:
    """``regions``: auto by default; a bare YAML ``off`` (read as false) is the word ``off``;
    class names are kept sorted and enter the key."""
    assert parse_manifest(minimal(), base_dir=tmp_path).regions == "auto"
    off = load_manifest(write(tmp_path, yaml.safe_dump(minimal()) + "regions: off\n"))
    assert off.regions == "off"
    named = parse_manifest(minimal(regions=["Z", "LlamaDecoderLayer"]), base_dir=tmp_path)
    assert named.regions == ("LlamaDecoderLayer", "Z")
    keys = {json.dumps(m.key_factors(), sort_keys=True) for m in
            (parse_manifest(minimal(), base_dir=tmp_path), off, named)}
    assert len(keys) == 3
    assert parse_manifest(named.to_dict(), base_dir=tmp_path).regions == named.regions


def test_defaults_applied(tmp_path: Path) -> None:
    m = parse_manifest(minimal(), base_dir=tmp_path)
    assert (m.dtype, m.device, m.max_tokens, m.cudagraph) == ("float32", "cpu", 4096, "piecewise")
    assert (m.compile_sizes, m.capture_sizes, m.splitting_ops) == ((), (), ())
    assert m.inductor == {} and m.store is None and m.path is None and m.base_dir == tmp_path.resolve()
    assert (m.tolerance.atol, m.tolerance.rtol) == (1e-4, 1e-4)
    assert (m.model.weights, m.model.weights_path, m.model.seed, m.model.output) == ("random", None, 0, None)
    assert m.model.kwargs == {}
    assert m.inputs[0] == InputSpec("input_ids", "int64", ("tokens",), "random", 0, 10)


def test_sizes_sorted_and_paths_resolved(tmp_path: Path) -> None:
    (tmp_path / "models").mkdir()
    (tmp_path / "models" / "net.py").write_text("def build(): ...\n")
    d = minimal(compile_sizes=[16, 1, 4], capture_sizes=[8, 2], splitting_ops=["b::y", "a::x.default"],
                store="cache-dir", tolerance={"atol": 0})
    d["model"] = {"factory": "./models/net.py:build", "weights": "w/model.safetensors"}
    m = parse_manifest(d, base_dir=tmp_path)
    assert m.compile_sizes == (1, 4, 16) and m.capture_sizes == (2, 8)
    assert m.splitting_ops == ("a::x.default", "b::y")
    assert m.store == (tmp_path / "cache-dir").resolve()
    assert m.model.factory == "./models/net.py:build"  # the original string is kept
    assert m.model.factory_file == (tmp_path / "models" / "net.py").resolve()
    assert m.model.factory_fn == "build" and m.model.factory_module is None
    assert m.model.weights_path == (tmp_path / "w" / "model.safetensors").resolve()
    assert m.tolerance.atol == 0.0 and isinstance(m.tolerance.atol, float)


def test_yaml_exponent_without_dot_is_a_float(tmp_path: Path) -> None:
    text = yaml.safe_dump(minimal()) + "tolerance: {atol: 1e-3, rtol: 2E-5}\n"
    m = load_manifest(write(tmp_path, text))
    assert (m.tolerance.atol, m.tolerance.rtol) == (1e-3, 2e-5)


def test_frozen_and_hashable() -> None:
    m = load_manifest(MANIFESTS / "toy-llama.yaml")
    with pytest.raises(dataclasses.FrozenInstanceError):
        m.name = "x"  # type: ignore[misc]
    with pytest.raises(TypeError):
        m.model.kwargs["layers"] = 3  # type: ignore[index]
    assert isinstance(m.model.kwargs, FrozenMap) and isinstance(m.inputs, tuple)
    assert hash(m) == hash(load_manifest(MANIFESTS / "toy-llama.yaml"))


def test_nested_json_values_frozen_and_thawed(tmp_path: Path) -> None:
    d = minimal(inductor={"max_autotune": False, "triton.cudagraphs": False, "x": {"l": [1, 2.5]}})
    d["model"]["kwargs"] = {"dims": [1, 2], "sub": {"a": None}}
    m = parse_manifest(d, base_dir=tmp_path)
    assert m.model.kwargs["dims"] == (1, 2) and isinstance(m.model.kwargs["sub"], FrozenMap)
    assert thaw(m.model.kwargs) == {"dims": [1, 2], "sub": {"a": None}}
    assert m.to_dict()["inductor"] == thaw(m.inductor) == d["inductor"]


def test_hf_config_from_path_is_keyed_by_content(tmp_path: Path) -> None:
    cfg = {"hidden_size": 64, "vocab_size": 256}
    (tmp_path / "cfgdir").mkdir()
    (tmp_path / "cfgdir" / "config.json").write_text(json.dumps(cfg))
    (tmp_path / "c.json").write_text(json.dumps(cfg))
    ms = []
    for config in ("cfgdir", "c.json", cfg):
        d = minimal()
        d["model"] = {"hf": {"architecture": "LlamaForCausalLM", "config": config}}
        ms.append(parse_manifest(d, base_dir=tmp_path))
    assert ms[0].model.hf.config_file == (tmp_path / "cfgdir" / "config.json").resolve()
    assert ms[0].model.hf.config_path == "cfgdir" and ms[0].model.hf.config == cfg
    assert ms[0].key_factors() == ms[1].key_factors() == ms[2].key_factors()
    assert str(tmp_path) not in json.dumps(ms[0].key_factors())


# ------------------------------------------------------------------ key factors, to_dict, replace


def test_key_factors_plain_json_and_stable() -> None:
    m = load_manifest(MANIFESTS / "toy-llama.yaml")
    kf = m.key_factors()
    assert json.loads(json.dumps(kf)) == kf
    for absent in ("name", "store", "path", "base_dir", "capture_sizes", "cudagraph", "tolerance"):
        assert absent not in kf
    assert "weights" not in kf["model"] and "seed" not in kf["model"]
    assert kf["model"]["factory"] == "aotc.models.toy_llama:build"
    assert kf["compile_sizes"] == [1, 2, 4, 8, 16] and kf["splitting_ops"] == ["aotc::attention"]
    assert kf == load_manifest(MANIFESTS / "toy-llama.yaml").key_factors()
    assert "/work" not in json.dumps(kf) and str(ROOT) not in json.dumps(kf)


def test_key_factors_ignore_what_does_not_change_artifacts(tmp_path: Path) -> None:
    m = load_manifest(MANIFESTS / "toy-llama.yaml")
    other = m.replace(name="renamed", store=str(tmp_path / "s"), capture_sizes=[4], cudagraph="none",
                      tolerance={"atol": 1, "rtol": 0.5})
    other = other.replace(model=dataclasses.replace(m.model, weights="w.safetensors", seed=7))
    assert other.key_factors() == m.key_factors()
    assert other.to_dict() != m.to_dict()
    for change in ({"compile_sizes": [1, 2]}, {"dtype": "bfloat16"}, {"max_tokens": 2048},
                   {"splitting_ops": []}, {"inductor": {"max_autotune": True}}, {"device": "cuda"}):
        assert m.replace(**change).key_factors() != m.key_factors(), change
    kw = dataclasses.replace(m.model, kwargs=FrozenMap({**m.model.kwargs, "layers": 3}))
    assert m.replace(model=kw).key_factors() != m.key_factors()


def test_key_factors_file_factory_relative_to_manifest_dir(tmp_path: Path) -> None:
    keys = []
    for where in ("a", "b/deeper"):
        d = tmp_path / where
        (d / "models").mkdir(parents=True)
        (d / "models" / "net.py").write_text("def build(): ...\n")
        text = yaml.safe_dump(minimal(model={"factory": "./models/../models/net.py:build"}))
        m = load_manifest(write(d, text))
        keys.append(m.key_factors())
        assert m.model.factory_file == (d / "models" / "net.py").resolve()
    assert keys[0] == keys[1]
    assert keys[0]["model"]["factory"] == "models/net.py:build"
    assert str(tmp_path) not in json.dumps(keys[0])


def test_to_dict_round_trips(tmp_path: Path) -> None:
    for f in ("toy-llama.yaml", "tiny-hf-llama.yaml"):
        m = load_manifest(MANIFESTS / f)
        d = m.to_dict()
        assert json.loads(json.dumps(d)) == d
        assert parse_manifest(d, base_dir=m.base_dir) == dataclasses.replace(m, path=None)
        assert parse_manifest(yaml.safe_load(yaml.safe_dump(d)), base_dir=m.base_dir).to_dict() == d


def test_replace_validates(tmp_path: Path) -> None:
    m = load_manifest(MANIFESTS / "toy-llama.yaml")
    r = m.replace(compile_sizes=(8, 2))
    assert r.compile_sizes == (2, 8) and r.path == m.path and r.name == m.name
    with pytest.raises(ManifestError, match=r"compile_sizes\[0\]: size 8192 exceeds max_tokens"):
        m.replace(compile_sizes=[8192])
    with pytest.raises(ManifestError, match=r"dtype: expected one of"):
        m.replace(dtype="float64")
    with pytest.raises(TypeError, match="nope"):
        m.replace(nope=1)
    assert m.replace(inputs=m.inputs[:1]).inputs == m.inputs[:1]


def test_manifest_module_does_not_import_torch() -> None:
    code = "import sys, aotc.manifest; assert 'torch' not in sys.modules, 'torch imported'"
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT)


# ------------------------------------------------------------------ bad manifests

Mutation = Callable[[dict[str, Any]], Any]


def top(**kw: Any) -> Mutation:
    return lambda d: d.update(kw)


def mod(**kw: Any) -> Mutation:
    return lambda d: d["model"].update(kw)


def inp(**kw: Any) -> Mutation:
    return lambda d: d["inputs"][0].update(kw)


# (id, raw YAML text or a mutation of MINIMAL, the field path expected in the message, a fragment)
BAD: list[tuple[str, str | Mutation, str, str]] = [
    ("malformed_yaml", "name: x\nmodel: {factory: a:b\ninputs: [\n", "line 3, column 7", "invalid YAML"),
    ("bad_indent", "name: x\n  model: 1\n", "line 2, column 8", "invalid YAML"),
    ("duplicate_key", "name: a\nname: b\n", "line 2, column 1", "duplicate key 'name'"),
    ("empty_file", "", "", "empty"),
    ("comments_only", "# nothing\n", "", "empty"),
    ("top_level_list", "- name: x\n", "", "expected a mapping at the top level, got a list"),
    ("top_level_scalar", "just text\n", "", "expected a mapping at the top level"),
    ("unknown_top_key", top(compile_size=[1]), "compile_size", "did you mean 'compile_sizes'"),
    ("unknown_model_key", mod(factroy="x:y"), "model.factroy", "allowed: factory, hf"),
    ("unknown_input_key", inp(token_dim=0), "inputs[0].token_dim", "unknown key"),
    ("unknown_tolerance_key", top(tolerance={"abs": 1}), "tolerance.abs", "allowed: atol, rtol"),
    ("unknown_hf_key", top(model={"hf": {"architecture": "A", "config": {}, "x": 1}}),
     "model.hf.x", "unknown key 'x'"),
    ("missing_name", lambda d: d.pop("name"), "name", "required key is missing"),
    ("missing_inputs", lambda d: d.pop("inputs"), "inputs", "required key is missing"),
    ("missing_shape", lambda d: d["inputs"][0].pop("shape"), "inputs[0].shape", "required"),
    ("bad_name", top(name="my model"), "name", "got 'my model'"),
    ("name_not_str", top(name=3), "name", "got 3"),
    ("model_not_mapping", top(model="pkg:fn"), "model", "expected a mapping, got 'pkg:fn'"),
    ("wrong_type_sizes", top(compile_sizes="1,2"), "compile_sizes", "expected a list"),
    ("size_string", top(capture_sizes=[1, 2, "8x"]), "capture_sizes[2]",
     "expected a positive int, got '8x'"),
    ("size_float", top(compile_sizes=[4.0]), "compile_sizes[0]", "got 4.0"),
    ("bool_for_int", top(max_tokens=True), "max_tokens", "got true (a bool)"),
    ("bool_size", top(compile_sizes=[1, True]), "compile_sizes[1]", "(a bool)"),
    ("bool_seed", mod(seed=False), "model.seed", "(a bool)"),
    ("negative_size", top(compile_sizes=[-4]), "compile_sizes[0]", "positive int"),
    ("zero_size", top(capture_sizes=[0, 1]), "capture_sizes[0]", "got 0"),
    ("duplicate_size", top(compile_sizes=[1, 2, 2]), "compile_sizes[2]", "duplicate size 2"),
    ("size_over_max", top(max_tokens=64, capture_sizes=[32, 128]), "capture_sizes[1]",
     "exceeds max_tokens (64)"),
    ("zero_max_tokens", top(max_tokens=0), "max_tokens", "positive int"),
    ("bad_dtype", top(dtype="fp8"), "dtype", "float32 | float16 | bfloat16"),
    ("bad_input_dtype", inp(dtype="long"), "inputs[0].dtype", "got 'long'"),
    ("bad_device", top(device="tpu"), "device", "expected one of cpu | cuda"),
    ("bad_cudagraph", top(cudagraph=False), "cudagraph", "none | piecewise | full"),
    ("both_factory_and_hf", mod(hf={"architecture": "A", "config": {}}), "model",
     "exactly one of 'factory'"),
    ("neither_factory_nor_hf", top(model={"kwargs": {}}), "model", "got neither"),
    ("factory_no_colon", mod(factory="pkg.mod.build"), "model.factory", "pkg.module:fn"),
    ("factory_bad_module", mod(factory="pkg mod:build"), "model.factory", "got 'pkg mod:build'"),
    ("factory_empty_fn", mod(factory="pkg.mod:"), "model.factory", "pkg.module:fn"),
    ("factory_missing_file", mod(factory="nets/absent.py:build"), "model.factory",
     "no Python file at"),
    ("kwargs_not_json", mod(kwargs={"when": __import__("datetime").date(2024, 1, 1)}),
     "model.kwargs.when", "plain JSON value"),
    ("kwargs_nan", mod(kwargs={"eps": [1.0, float("nan")]}), "model.kwargs.eps[1]",
     "finite number"),
    ("pickle_weights", mod(weights="model.bin"), "model.weights", ".safetensors"),
    ("bool_output", mod(output=True), "model.output", "attribute name or an int"),
    ("hf_config_missing_file", top(model={"hf": {"architecture": "A", "config": "nope.json"}}),
     "model.hf.config", "config file not found"),
    ("hf_bad_architecture", top(model={"hf": {"architecture": "a-b", "config": {}}}),
     "model.hf.architecture", "class name"),
    ("empty_inputs", top(inputs=[]), "inputs", "non-empty list"),
    ("no_tokens_input", inp(shape=[1, 8]), "inputs", "no input has a 'tokens' dim"),
    ("two_tokens_in_shape", inp(shape=["tokens", "tokens"]), "inputs[0].shape[1]",
     "at most one"),
    ("bad_dim", inp(shape=["tokens", "seq"]), "inputs[0].shape[1]",
     "positive int or 'tokens'"),
    ("bad_fill", inp(fill="linspace"), "inputs[0].fill", "random | arange | zeros | ones"),
    ("high_with_arange", inp(fill="arange"), "inputs[0].high", "not used with fill: arange"),
    ("int_random_no_high", lambda d: d["inputs"][0].pop("high"), "inputs[0].high", "required for a random"),
    ("high_not_above_low", inp(low=10), "inputs[0].high", "greater than low (10)"),
    ("duplicate_input_name", lambda d: d["inputs"].append(d["inputs"][0]), "inputs[1].name", "duplicate"),
    ("bad_splitting_op", top(splitting_ops=["aotc.attention"]), "splitting_ops[0]", "namespace::op"),
    ("dup_splitting_op", top(splitting_ops=["a::b", "a::b"]), "splitting_ops[1]", "duplicate op"),
    ("inductor_not_mapping", top(inductor=["max_autotune"]), "inductor", "expected a mapping"),
    ("inductor_bad_value", top(inductor={"opt": {1, 2}}), "inductor.opt", "plain JSON value"),
    ("negative_tolerance", top(tolerance={"rtol": -1}), "tolerance.rtol", "non-negative number"),
    ("string_tolerance", top(tolerance={"atol": "small"}), "tolerance.atol", "got 'small'"),
    ("store_not_str", top(store=5), "store", "a store directory"),
]


def _text(case: str | Mutation) -> str:
    if isinstance(case, str):
        return case
    d = copy.deepcopy(MINIMAL)
    case(d)
    return yaml.dump(d, sort_keys=False)  # full Dumper: lets a date or a set through to the validator


@pytest.mark.parametrize(("case", "field", "fragment"), [c[1:] for c in BAD], ids=[c[0] for c in BAD])
def test_bad_manifest(tmp_path: Path, case: str | Mutation, field: str, fragment: str) -> None:
    path = write(tmp_path, _text(case), "bad.yaml")
    with pytest.raises(ManifestError) as info:
        load_manifest(path)
    msg = str(info.value)
    assert "\n" not in msg and msg.startswith(f"{path}: ")
    assert (f": {field}: " if field else f"{path}: ") in msg, msg
    assert fragment in msg, msg
    assert info.value.exit_code == 2 and info.value.file == str(path)
    if field and not field.startswith("line "):
        assert info.value.field == field


def test_bad_manifest_table_is_big_enough() -> None:
    assert len(BAD) >= 20


@pytest.mark.parametrize("name", ["missing.yaml", "sub/dir/missing.yaml"])
def test_missing_file(tmp_path: Path, name: str) -> None:
    with pytest.raises(ManifestError, match="no such file") as info:
        load_manifest(tmp_path / name)
    assert str(info.value).startswith(str(tmp_path / name))


def test_directory_and_non_utf8(tmp_path: Path) -> None:
    with pytest.raises(ManifestError, match="is a directory"):
        load_manifest(tmp_path)
    (tmp_path / "bin.yaml").write_bytes(b"name: \xff\xfe\n")
    with pytest.raises(ManifestError, match="not UTF-8"):
        load_manifest(tmp_path / "bin.yaml")


def test_python_tags_refused(tmp_path: Path) -> None:
    path = write(tmp_path, "name: !!python/object/apply:os.system ['true']\n")
    with pytest.raises(ManifestError, match=r"line 1, column \d+: invalid YAML"):
        load_manifest(path)


def test_parse_manifest_names_given_file() -> None:
    with pytest.raises(ManifestError, match=r"^x\.yaml: dtype: "):
        parse_manifest(minimal(dtype=1), file="x.yaml")
    with pytest.raises(ManifestError, match=r"^<manifest>: expected a mapping at the top level"):
        parse_manifest(["x"])  # type: ignore[arg-type]


def test_manifest_type_exported() -> None:
    assert Manifest.__dataclass_params__.frozen  # type: ignore[attr-defined]
