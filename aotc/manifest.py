"""Parse and validate ``model.yaml`` into a frozen :class:`Manifest` (pyyaml + stdlib only; no torch).

Every problem raises ``ManifestError(file, field_path, problem)``, one line, e.g.
``manifests/x.yaml: capture_sizes[2]: expected a positive int, got '8x'``. Unknown keys are errors,
``bool`` is never an int, relative paths resolve against the manifest's directory. Floats such as
``1e-4`` are read as numbers (YAML 1.2 style; plain PyYAML would read them as strings).
Schema and defaults: see ``manifests/toy-llama.yaml`` and the dataclasses below.
"""

from __future__ import annotations

import dataclasses
import difflib
import errno
import json
import math
import os
import re
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from aotc.errors import ManifestError

__all__ = [
    "Manifest", "ModelSpec", "HFSpec", "InputSpec", "Tolerance", "FrozenMap", "thaw",
    "load_manifest", "parse_manifest",
    "DTYPES", "INPUT_DTYPES", "DEVICES", "FILLS", "CUDAGRAPH_MODES", "TOKENS",
]

DTYPES = ("float32", "float16", "bfloat16")
INPUT_DTYPES = ("int64", "int32", "float32", "float16", "bfloat16", "bool")
DEVICES = ("cpu", "cuda")
FILLS = ("random", "arange", "zeros", "ones")
CUDAGRAPH_MODES = ("none", "piecewise", "full")
TOKENS = "tokens"  # the shape entry that marks an input's token (dynamic) dim

_NAME = re.compile(r"[A-Za-z0-9._-]+")
_IDENT = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_DOTTED = re.compile(r"[A-Za-z_][A-Za-z0-9_]*(?:\.[A-Za-z_][A-Za-z0-9_]*)*")
_OP = re.compile(r"[A-Za-z_][A-Za-z0-9_]*::[A-Za-z_][A-Za-z0-9_]*(?:\.[A-Za-z_][A-Za-z0-9_]*)?")
_PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl")


class FrozenMap(Mapping[str, Any]):
    """An immutable, hashable str-keyed mapping; values are frozen JSON (lists become tuples)."""

    __slots__ = ("_d",)

    def __init__(self, items: Mapping[str, Any] | None = None) -> None:
        self._d = dict(items or {})

    def __getitem__(self, key: str) -> Any:
        return self._d[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self._d)

    def __len__(self) -> int:
        return len(self._d)

    def __hash__(self) -> int:
        return hash(frozenset(self._d.items()))

    def __repr__(self) -> str:
        return f"FrozenMap({self._d!r})"


def thaw(value: Any) -> Any:
    """Turn frozen JSON (``FrozenMap``, tuples) back into plain dicts and lists."""
    if isinstance(value, Mapping):
        return {k: thaw(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [thaw(v) for v in value]
    return value


@dataclass(frozen=True)
class HFSpec:
    """A transformers architecture and its config (held inline; read from JSON if given as a path)."""

    architecture: str
    config: FrozenMap
    config_path: str | None = None  # as written in the manifest, when config was given as a path
    config_file: Path | None = None  # the absolute path of the JSON file that was read


@dataclass(frozen=True)
class ModelSpec:
    """How to build the model: exactly one of ``factory`` / ``hf``."""

    factory: str | None = None  # as written: "pkg.module:fn" or "path/to/file.py:fn"
    factory_module: str | None = None  # "pkg.module" when the factory names a module
    factory_file: Path | None = None  # absolute path when the factory names a .py file
    factory_fn: str | None = None  # the callable's (possibly dotted) name
    hf: HFSpec | None = None
    kwargs: FrozenMap = field(default_factory=FrozenMap)
    weights: str = "random"  # as written: "random" or a .safetensors file / HF model dir
    weights_path: Path | None = None  # absolute; existence is checked when the model is built
    seed: int = 0
    output: str | int | None = None  # attribute name or index picking the tensor to return


@dataclass(frozen=True)
class InputSpec:
    """One forward argument. ``fill: random`` draws ints from [low, high); floats use uniform
    [low, high) when ``high`` is set, else a standard normal; bools draw 0/1."""

    name: str
    dtype: str
    shape: tuple[int | str, ...]
    fill: str = "random"
    low: int | float = 0
    high: int | float | None = None

    @property
    def token_dim(self) -> int | None:
        """The index of the ``"tokens"`` dim in ``shape``, or None."""
        return self.shape.index(TOKENS) if TOKENS in self.shape else None


@dataclass(frozen=True)
class Tolerance:
    """Tolerances of the compile-time numeric check against eager."""

    atol: float = 1e-4
    rtol: float = 1e-4


@dataclass(frozen=True)
class Manifest:
    """A validated manifest. Build it with :func:`load_manifest` or :func:`parse_manifest`."""

    name: str
    model: ModelSpec
    inputs: tuple[InputSpec, ...]
    dtype: str = "float32"
    device: str = "cpu"
    compile_sizes: tuple[int, ...] = ()  # sorted
    capture_sizes: tuple[int, ...] = ()  # sorted
    max_tokens: int = 4096
    splitting_ops: tuple[str, ...] = ()  # sorted
    inductor: FrozenMap = field(default_factory=FrozenMap)
    cudagraph: str = "piecewise"
    tolerance: Tolerance = field(default_factory=Tolerance)
    store: Path | None = None  # absolute; not part of the key
    path: Path | None = None  # the manifest file (absolute), None when parsed from a dict
    base_dir: Path | None = None  # where relative paths were resolved from

    def to_dict(self) -> dict[str, Any]:
        """The full normalized manifest as plain JSON types; ``parse_manifest(m.to_dict(),
        base_dir=m.base_dir)`` rebuilds an equal manifest (with ``path=None``)."""
        return {
            "name": self.name, "model": _model_dict(self.model), "dtype": self.dtype,
            "device": self.device, "inputs": [_input_dict(s) for s in self.inputs],
            "compile_sizes": list(self.compile_sizes), "capture_sizes": list(self.capture_sizes),
            "max_tokens": self.max_tokens, "splitting_ops": list(self.splitting_ops),
            "inductor": thaw(self.inductor), "cudagraph": self.cudagraph,
            "tolerance": {"atol": self.tolerance.atol, "rtol": self.tolerance.rtol},
            "store": None if self.store is None else str(self.store),
        }

    def key_factors(self) -> dict[str, Any]:
        """The ``manifest`` key factor group: :meth:`to_dict` minus what cannot change an artifact,
        with no absolute paths, so machines that should share artifacts compute the same key.

        Left out: ``name``, ``store`` (labels and locations); ``capture_sizes``, ``cudagraph``
        (CUDA Graphs are captured at load time from the same artifacts); ``tolerance`` (only the
        compile-time check uses it); ``model.weights`` and ``model.seed``: parameters and buffers
        are graph inputs (DESIGN, "torch facts"), so weight values never reach an artifact -- random
        init or a file, the same artifacts serve, and a weights path differs per machine anyway.
        A factory given as a file is keyed by its path relative to the manifest dir (its source is
        covered by the ``code`` factor); an hf config given as a path is keyed by its contents.
        """
        d = self.to_dict()
        for k in ("name", "store", "capture_sizes", "cudagraph", "tolerance"):
            del d[k]
        model = d["model"]
        del model["weights"], model["seed"]
        m = self.model
        if m.factory_file is not None:
            rel = os.path.relpath(m.factory_file, self.base_dir or Path.cwd())
            model["factory"] = f"{Path(rel).as_posix()}:{m.factory_fn}"
        if m.hf is not None:
            model["hf"] = {"architecture": m.hf.architecture, "config": thaw(m.hf.config)}
        return d

    def replace(self, **changes: Any) -> Manifest:
        """A copy with top-level fields changed, validated like a fresh manifest (so it raises
        ``ManifestError`` on bad values). Values may be plain (lists, dicts, str paths) or the
        frozen types. An unknown field name is a ``TypeError``."""
        unknown = set(changes) - {f.name for f in dataclasses.fields(self)}
        if unknown:
            raise TypeError(f"Manifest.replace() got unknown field(s): {', '.join(sorted(unknown))}")
        path = changes.pop("path", self.path)
        base_dir = changes.pop("base_dir", self.base_dir)
        data = self.to_dict()
        data.update({k: _plain(v) for k, v in changes.items()})
        file = str(path) if path is not None else "<manifest>"
        return dataclasses.replace(parse_manifest(data, file, base_dir), path=path)


def _model_dict(m: ModelSpec) -> dict[str, Any]:
    hf = None
    if m.hf is not None:
        cfg = m.hf.config_path if m.hf.config_path is not None else thaw(m.hf.config)
        hf = {"architecture": m.hf.architecture, "config": cfg}
    return {"factory": m.factory, "hf": hf, "kwargs": thaw(m.kwargs), "weights": m.weights,
            "seed": m.seed, "output": m.output}


def _input_dict(s: InputSpec) -> dict[str, Any]:
    return {"name": s.name, "dtype": s.dtype, "shape": list(s.shape), "fill": s.fill,
            "low": s.low, "high": s.high}


def _plain(v: Any) -> Any:
    if isinstance(v, ModelSpec):
        return _model_dict(v)
    if isinstance(v, InputSpec):
        return _input_dict(v)
    if dataclasses.is_dataclass(v) and not isinstance(v, type):
        return {f.name: _plain(getattr(v, f.name)) for f in dataclasses.fields(v)}
    if isinstance(v, Mapping):
        return {k: _plain(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [_plain(x) for x in v]
    return str(v) if isinstance(v, Path) else v


# ---------------------------------------------------------------- YAML


class _Loader(yaml.SafeLoader):
    """SafeLoader that reads ``1e-4`` as a float and refuses duplicate keys."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        seen: set[Any] = set()
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":
                continue
            key = self.construct_object(key_node, deep=True)
            if isinstance(key, (str, int, float, bool)) or key is None:
                if key in seen:
                    raise yaml.constructor.ConstructorError(
                        None, None, f"duplicate key {key!r}", key_node.start_mark)
                seen.add(key)
        return super().construct_mapping(node, deep=deep)


_Loader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"^[-+]?(?:[0-9][0-9_]*)(?:\.[0-9_]*)?[eE][-+]?[0-9]+$"),
    list("-+0123456789"),
)


def _load_yaml(text: str, file: str) -> Any:
    try:
        return yaml.load(text, Loader=_Loader)  # noqa: S506 - a SafeLoader subclass
    except yaml.MarkedYAMLError as e:
        mark = e.problem_mark or e.context_mark
        where = f"line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        problem = " ".join(str(e.problem or e.context or "syntax error").split())
        raise ManifestError(file, where, f"invalid YAML: {problem}") from None
    except yaml.YAMLError as e:
        raise ManifestError(file, "", f"invalid YAML: {' '.join(str(e).split())}") from None


# ---------------------------------------------------------------- public entry points


def load_manifest(path: str | os.PathLike[str]) -> Manifest:
    """Read, parse and validate the manifest file at ``path``; relative paths in it resolve
    against its directory. Raises ``ManifestError`` (missing file, bad YAML, invalid field)."""
    file, p = os.fspath(path), Path(path)
    try:
        text = p.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise ManifestError(file, "", f"not UTF-8 text ({e.reason} at byte {e.start})") from None
    except OSError as e:
        why = {errno.ENOENT: "no such file", errno.EISDIR: "is a directory"}.get(
            e.errno, f"cannot read it: {e.strerror}")
        raise ManifestError(file, "", f"{why}; pass the path of a model.yaml manifest") from None
    data = _load_yaml(text, file)
    if data is None:
        raise ManifestError(file, "", "the file is empty; a manifest needs at least name, model and inputs")
    p = p.resolve()
    return dataclasses.replace(parse_manifest(data, file, p.parent), path=p)


def parse_manifest(
    data: Mapping[str, Any], file: str = "<manifest>", base_dir: Path | None = None
) -> Manifest:
    """Validate an already-loaded manifest mapping. ``file`` names it in errors; relative paths
    resolve against ``base_dir`` (default: the current directory). Raises ``ManifestError``."""
    base = Path(base_dir if base_dir is not None else Path.cwd()).resolve()
    try:
        return _parse(data, base)
    except _Invalid as e:
        raise ManifestError(file, e.field, e.problem) from None


# ---------------------------------------------------------------- validation


class _Invalid(Exception):
    def __init__(self, field_path: str, problem: str) -> None:
        super().__init__(problem)
        self.field, self.problem = field_path, problem


def _join(path: str, key: str) -> str:
    if not re.fullmatch(r"[A-Za-z0-9_][\w.-]*", key, re.ASCII):
        return f"{path}[{key!r}]"
    return f"{path}.{key}" if path else key


def _show(v: Any) -> str:
    if v is None:
        return "null"
    if isinstance(v, bool):
        return f"{str(v).lower()} (a bool)"
    if isinstance(v, Mapping):
        return "a mapping"
    if isinstance(v, (list, tuple)):
        return "a list"
    s = repr(v)
    return s if len(s) <= 60 else s[:57] + "..."


def _keys(d: Any, path: str, required: tuple[str, ...], optional: tuple[str, ...]) -> Mapping[str, Any]:
    if not isinstance(d, Mapping):
        raise _Invalid(path, f"expected a mapping, got {_show(d)}")
    allowed = (*required, *optional)
    for k in d:
        if k not in allowed:
            close = difflib.get_close_matches(str(k), allowed, n=1)
            hint = f"did you mean {close[0]!r}? " if close else ""
            raise _Invalid(_join(path, str(k)), f"unknown key {k!r}; {hint}allowed: {', '.join(allowed)}")
    for k in required:
        if k not in d:
            raise _Invalid(_join(path, k), "required key is missing")
    return d


def _str(v: Any, path: str, pattern: re.Pattern[str] | None = None, what: str = "") -> str:
    if not isinstance(v, str) or not v.strip():
        raise _Invalid(path, f"expected {what or 'a non-empty string'}, got {_show(v)}")
    if pattern is not None and not pattern.fullmatch(v):
        raise _Invalid(path, f"expected {what}, got {v!r}")
    return v


def _int(v: Any, path: str, minimum: int | None = None, what: str = "") -> int:
    if not what:
        what = "a positive int" if minimum == 1 else "a non-negative int" if minimum == 0 else "an int"
    if isinstance(v, bool) or not isinstance(v, int) or (minimum is not None and v < minimum):
        raise _Invalid(path, f"expected {what}, got {_show(v)}")
    return v


def _num(v: Any, path: str, minimum: float | None = None) -> float:
    what = "a non-negative number" if minimum == 0 else "a number"
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) \
            or (minimum is not None and v < minimum):
        raise _Invalid(path, f"expected {what}, got {_show(v)}")
    return float(v)


def _choice(v: Any, path: str, choices: tuple[str, ...]) -> str:
    if not isinstance(v, str) or v not in choices:
        raise _Invalid(path, f"expected one of {' | '.join(choices)}, got {_show(v)}")
    return v


def _seq(v: Any, path: str) -> list[Any] | tuple[Any, ...]:
    if not isinstance(v, (list, tuple)):
        raise _Invalid(path, f"expected a list, got {_show(v)}")
    return v


def _json(v: Any, path: str) -> Any:
    """Validate plain JSON (finite floats, str keys) and freeze it."""
    if v is None or isinstance(v, (bool, int, str)):
        return v
    if isinstance(v, float):
        if not math.isfinite(v):
            raise _Invalid(path, f"expected a finite number, got {v!r}")
        return v
    if isinstance(v, (list, tuple)):
        return tuple(_json(x, f"{path}[{i}]") for i, x in enumerate(v))
    if isinstance(v, Mapping):
        for k in v:
            if not isinstance(k, str):
                raise _Invalid(path, f"mapping keys must be strings, got {_show(k)}")
        return FrozenMap({k: _json(x, _join(path, k)) for k, x in v.items()})
    raise _Invalid(path, f"expected a plain JSON value (null, bool, number, string, list, mapping), "
                         f"got {type(v).__name__} {_show(v)}")


def _resolve(base: Path, p: str) -> Path:
    return (base / os.path.expanduser(p)).resolve()


def _sizes(v: Any, path: str, max_tokens: int) -> tuple[int, ...]:
    seen: set[int] = set()
    for i, x in enumerate(_seq(v, path)):
        n = _int(x, f"{path}[{i}]", 1)
        if n in seen:
            raise _Invalid(f"{path}[{i}]", f"duplicate size {n}")
        if n > max_tokens:
            raise _Invalid(f"{path}[{i}]", f"size {n} exceeds max_tokens ({max_tokens}); "
                                            "raise max_tokens or drop the size")
        seen.add(n)
    return tuple(sorted(seen))


def _parse(data: Any, base: Path) -> Manifest:
    if not isinstance(data, Mapping):
        raise _Invalid("", f"expected a mapping at the top level, got {_show(data)}")
    _keys(data, "", ("name", "model", "inputs"), (
        "dtype", "device", "compile_sizes", "capture_sizes", "max_tokens", "splitting_ops",
        "inductor", "cudagraph", "tolerance", "store"))
    name = _str(data["name"], "name", _NAME, "a name of letters, digits, '.', '_' or '-'")
    max_tokens = _int(data.get("max_tokens", 4096), "max_tokens", 1)
    tol = data.get("tolerance", {})
    store = data.get("store")
    return Manifest(  # keyword arguments are checked in order: the first error in schema order wins
        name=name,
        model=_model(data["model"], base),
        dtype=_choice(data.get("dtype", "float32"), "dtype", DTYPES),
        device=_choice(data.get("device", "cpu"), "device", DEVICES),
        inputs=_inputs(data["inputs"]),
        compile_sizes=_sizes(data.get("compile_sizes", ()), "compile_sizes", max_tokens),
        capture_sizes=_sizes(data.get("capture_sizes", ()), "capture_sizes", max_tokens),
        max_tokens=max_tokens,
        splitting_ops=_ops(data.get("splitting_ops", ())),
        inductor=_inductor(data.get("inductor", {})),
        cudagraph=_choice(data.get("cudagraph", "piecewise"), "cudagraph", CUDAGRAPH_MODES),
        tolerance=Tolerance(
            _num(_keys(tol, "tolerance", (), ("atol", "rtol")).get("atol", 1e-4), "tolerance.atol", 0),
            _num(tol.get("rtol", 1e-4), "tolerance.rtol", 0)),
        store=None if store is None else _resolve(base, _str(store, "store", what="a store directory")),
        base_dir=base,
    )


def _ops(v: Any) -> tuple[str, ...]:
    ops = _seq(v, "splitting_ops")
    for i, op in enumerate(ops):
        _str(op, f"splitting_ops[{i}]", _OP, '"namespace::op" or "namespace::op.overload"')
        if op in ops[:i]:
            raise _Invalid(f"splitting_ops[{i}]", f"duplicate op {op!r}")
    return tuple(sorted(ops))


def _inductor(v: Any) -> FrozenMap:
    if not isinstance(v, Mapping):
        raise _Invalid("inductor", f"expected a mapping of Inductor config patches, got {_show(v)}")
    for k in v:
        _str(k, _join("inductor", str(k)), _DOTTED, "an Inductor config name like 'max_autotune'")
    return _json(v, "inductor")


def _model(d: Any, base: Path) -> ModelSpec:
    _keys(d, "model", (), ("factory", "hf", "kwargs", "weights", "seed", "output"))
    factory, hf = d.get("factory"), d.get("hf")
    if (factory is None) == (hf is None):
        got = "both" if factory is not None else "neither"
        raise _Invalid("model", f"expected exactly one of 'factory' (\"pkg.module:fn\" or "
                                f"\"path/to/file.py:fn\") or 'hf' (a transformers architecture), got {got}")
    spec: dict[str, Any] = {}
    if factory is not None:
        fmt = '"pkg.module:fn" or "path/to/file.py:fn"'
        s = _str(factory, "model.factory", what=fmt)
        target, _, fn = s.rpartition(":")
        if not target or not _DOTTED.fullmatch(fn):
            raise _Invalid("model.factory", f"expected {fmt}, got {s!r}")
        if target.endswith(".py") or "/" in target or "\\" in target:
            file = _resolve(base, target)
            if file.suffix != ".py" or not file.is_file():
                raise _Invalid("model.factory", f"expected {fmt}; no Python file at {file}")
            spec.update(factory_file=file)
        elif _DOTTED.fullmatch(target):
            spec.update(factory_module=target)
        else:
            raise _Invalid("model.factory", f"expected {fmt}, got {s!r}")
        spec.update(factory=s, factory_fn=fn)
    else:
        spec["hf"] = _hf(hf, base)
    kwargs = d.get("kwargs", {})
    if not isinstance(kwargs, Mapping):
        raise _Invalid("model.kwargs", f"expected a mapping, got {_show(kwargs)}")
    weights = _str(d.get("weights", "random"), "model.weights",
                   what="'random', a .safetensors file or a model directory")
    if weights != "random":
        wp = _resolve(base, weights)
        if wp.suffix in _PICKLE_SUFFIXES or (wp.is_file() and wp.suffix != ".safetensors"):
            raise _Invalid("model.weights", f"expected 'random', a .safetensors file or a model directory, "
                                            f"got {weights!r} (convert pickle checkpoints to .safetensors)")
        spec["weights_path"] = wp
    output = d.get("output")
    if output is not None and not (isinstance(output, str) and _IDENT.fullmatch(output)) \
            and (isinstance(output, bool) or not isinstance(output, int)):
        raise _Invalid("model.output", f"expected an attribute name or an int index, got {_show(output)}")
    return ModelSpec(kwargs=_json(kwargs, "model.kwargs"), weights=weights,
                     seed=_int(d.get("seed", 0), "model.seed", 0), output=output, **spec)


def _hf(d: Any, base: Path) -> HFSpec:
    _keys(d, "model.hf", ("architecture", "config"), ())
    arch = _str(d["architecture"], "model.hf.architecture", _IDENT,
                "a transformers class name like LlamaForCausalLM")
    cfg = d["config"]
    if isinstance(cfg, Mapping):
        return HFSpec(arch, _json(cfg, "model.hf.config"))
    where = "model.hf.config"
    _str(cfg, where, what="an inline mapping or the path of a config dir / .json file")
    f = _resolve(base, cfg)
    f = f / "config.json" if f.is_dir() else f
    try:
        loaded = json.loads(f.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise _Invalid(where, f"config file not found: {f}") from None
    except (OSError, UnicodeDecodeError, ValueError) as e:
        raise _Invalid(where, f"cannot read {f} as JSON: {' '.join(str(e).split())}") from None
    if not isinstance(loaded, dict):
        raise _Invalid(where, f"{f} must hold a JSON object, got {_show(loaded)}")
    return HFSpec(arch, _json(loaded, where), config_path=cfg, config_file=f)


def _inputs(v: Any) -> tuple[InputSpec, ...]:
    if not _seq(v, "inputs"):
        raise _Invalid("inputs", "expected a non-empty list of inputs (the forward's arguments in order)")
    specs: list[InputSpec] = []
    for i, x in enumerate(v):
        p = f"inputs[{i}]"
        _keys(x, p, ("name", "dtype", "shape"), ("fill", "low", "high"))
        name = _str(x["name"], f"{p}.name", _IDENT, "a Python identifier")
        if any(s.name == name for s in specs):
            raise _Invalid(f"{p}.name", f"duplicate input name {name!r}")
        dtype = _choice(x["dtype"], f"{p}.dtype", INPUT_DTYPES)
        shape: list[int | str] = []
        for j, dim in enumerate(_seq(x["shape"], f"{p}.shape")):
            if dim == TOKENS and TOKENS in shape:
                raise _Invalid(f"{p}.shape[{j}]", "a second 'tokens' dim; an input has at most one")
            shape.append(dim if dim == TOKENS else
                         _int(dim, f"{p}.shape[{j}]", 1, "a positive int or 'tokens'"))
        fill = _choice(x.get("fill", "random"), f"{p}.fill", FILLS)
        low, high = x.get("low", 0), x.get("high")
        if fill != "random" or dtype == "bool":
            why = f"fill: {fill}" if fill != "random" else "dtype: bool"
            if high is not None:
                raise _Invalid(f"{p}.high", f"not used with {why}; remove it")
            if isinstance(low, bool) or low != 0:
                raise _Invalid(f"{p}.low", f"not used with {why}; remove it")
            low = 0
        elif dtype.startswith(("float", "bfloat")):
            low = _num(low, f"{p}.low")
            high = None if high is None else _num(high, f"{p}.high")
        else:
            low = _int(low, f"{p}.low")
            if high is None:
                raise _Invalid(f"{p}.high", f"required for a random {dtype} input: the exclusive "
                                            "upper bound (e.g. the vocab size)")
            high = _int(high, f"{p}.high")
        if high is not None and high <= low:
            raise _Invalid(f"{p}.high", f"expected a value greater than low ({low}), got {_show(high)}")
        specs.append(InputSpec(name, dtype, tuple(shape), fill, low, high))
    if not any(s.token_dim is not None for s in specs):
        raise _Invalid("inputs", "no input has a 'tokens' dim; mark the token dim of at least one "
                                 "input's shape with 'tokens'")
    return tuple(specs)
