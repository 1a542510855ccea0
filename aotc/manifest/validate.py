"""Validation of a manifest mapping into the frozen dataclasses of :mod:`aotc.manifest.schema`: one
checker per field, each raising :class:`Invalid` with the field path and what was expected."""

from __future__ import annotations

import difflib
import json
import math
import os
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from aotc.manifest.schema import (
    CLASS_RE,
    CUDAGRAPH_MODES,
    DEFAULT_TOLERANCE,
    DEVICES,
    DOTTED_RE,
    DTYPES,
    FILLS,
    IDENT_RE,
    INPUT_DTYPES,
    NAME_RE,
    OP_RE,
    PICKLE_SUFFIXES,
    TOKENS,
    FrozenMap,
    HFSpec,
    InputSpec,
    Manifest,
    ModelSpec,
    Tolerance,
)


class Invalid(Exception):
    """A field failed validation: ``field`` is its path, ``problem`` the one-line reason."""

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
        raise Invalid(path, f"expected a mapping, got {_show(d)}")
    allowed = (*required, *optional)
    for k in d:
        if k not in allowed:
            close = difflib.get_close_matches(str(k), allowed, n=1)
            hint = f"did you mean {close[0]!r}? " if close else ""
            raise Invalid(_join(path, str(k)), f"unknown key {k!r}; {hint}allowed: {', '.join(allowed)}")
    for k in required:
        if k not in d:
            raise Invalid(_join(path, k), "required key is missing")
    return d


def _str(v: Any, path: str, pattern: re.Pattern[str] | None = None, what: str = "") -> str:
    if not isinstance(v, str) or not v.strip():
        raise Invalid(path, f"expected {what or 'a non-empty string'}, got {_show(v)}")
    if pattern is not None and not pattern.fullmatch(v):
        raise Invalid(path, f"expected {what}, got {v!r}")
    return v


def _int(v: Any, path: str, minimum: int | None = None, what: str = "") -> int:
    if not what:
        what = "a positive int" if minimum == 1 else "a non-negative int" if minimum == 0 else "an int"
    if isinstance(v, bool) or not isinstance(v, int) or (minimum is not None and v < minimum):
        raise Invalid(path, f"expected {what}, got {_show(v)}")
    return v


def _num(v: Any, path: str, minimum: float | None = None) -> float:
    what = "a non-negative number" if minimum == 0 else "a number"
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) \
            or (minimum is not None and v < minimum):
        raise Invalid(path, f"expected {what}, got {_show(v)}")
    return float(v)


def _choice(v: Any, path: str, choices: tuple[str, ...]) -> str:
    if not isinstance(v, str) or v not in choices:
        raise Invalid(path, f"expected one of {' | '.join(choices)}, got {_show(v)}")
    return v


def _seq(v: Any, path: str) -> list[Any] | tuple[Any, ...]:
    if not isinstance(v, (list, tuple)):
        raise Invalid(path, f"expected a list, got {_show(v)}")
    return v


def _json(v: Any, path: str) -> Any:
    """Validate plain JSON (finite floats, str keys) and freeze it."""
    if v is None or isinstance(v, (bool, int, str)):
        return v
    if isinstance(v, float):
        if not math.isfinite(v):
            raise Invalid(path, f"expected a finite number, got {v!r}")
        return v
    if isinstance(v, (list, tuple)):
        return tuple(_json(x, f"{path}[{i}]") for i, x in enumerate(v))
    if isinstance(v, Mapping):
        for k in v:
            if not isinstance(k, str):
                raise Invalid(path, f"mapping keys must be strings, got {_show(k)}")
        return FrozenMap({k: _json(x, _join(path, k)) for k, x in v.items()})
    raise Invalid(path, f"expected a plain JSON value (null, bool, number, string, list, mapping), "
                         f"got {type(v).__name__} {_show(v)}")


_MAX_TOKENS = 2**31 - 1  # a token count is a tensor dim; nothing real comes near int32's range
_INT_RANGES = {"int64": (-2**63, 2**63 - 1), "int32": (-2**31, 2**31)}  # random fill: [low, high)


def _resolve(base: Path, p: str) -> Path:
    return (base / os.path.expanduser(p)).resolve()


def _sizes(v: Any, path: str, max_tokens: int) -> tuple[int, ...]:
    seen: set[int] = set()
    for i, x in enumerate(_seq(v, path)):
        n = _int(x, f"{path}[{i}]", 1)
        if n in seen:
            raise Invalid(f"{path}[{i}]", f"duplicate size {n}")
        if n > max_tokens:
            raise Invalid(f"{path}[{i}]", f"size {n} exceeds max_tokens ({max_tokens}); "
                                            "raise max_tokens or drop the size")
        seen.add(n)
    return tuple(sorted(seen))


def validate(data: Any, base: Path) -> Manifest:
    """The manifest a mapping describes; relative paths resolve against ``base``."""
    if not isinstance(data, Mapping):
        raise Invalid("", f"expected a mapping at the top level, got {_show(data)}")
    _keys(data, "", ("name", "model", "inputs"), (
        "dtype", "device", "compile_sizes", "capture_sizes", "max_tokens", "splitting_ops",
        "inductor", "cudagraph", "regions", "tolerance", "store"))
    name = _str(data["name"], "name", NAME_RE, "a name of letters, digits, '.', '_' or '-'")
    max_tokens = _int(data.get("max_tokens", 4096), "max_tokens", 1)
    if max_tokens > _MAX_TOKENS:
        raise Invalid("max_tokens", f"expected a positive int up to {_MAX_TOKENS} (2**31 - 1), "
                                    f"got {max_tokens}")
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
        regions=_regions(data.get("regions", "auto")),
        tolerance=_tolerance(tol, data.get("dtype", "float32")),
        store=None if store is None else _resolve(base, _str(store, "store", what="a store directory")),
        base_dir=base,
    )


def _regions(v: Any) -> str | tuple[str, ...]:
    """``auto``, ``off`` or a list of module class names (bare or dotted) traced once each. YAML
    reads a bare ``off`` as false (and ``on`` as true): taken as the words they were."""
    if isinstance(v, bool):
        return "auto" if v else "off"
    if isinstance(v, str):
        return _choice(v, "regions", ("auto", "off"))
    names = _seq(v, "regions")
    for i, name in enumerate(names):
        _str(name, f"regions[{i}]", CLASS_RE, "a module class name like 'LlamaDecoderLayer'")
        if name in names[:i]:
            raise Invalid(f"regions[{i}]", f"duplicate class {name!r}")
    if not names:
        raise Invalid("regions", 'expected "auto", "off" or a non-empty list of class names')
    return tuple(sorted(names))


def _ops(v: Any) -> tuple[str, ...]:
    ops = _seq(v, "splitting_ops")
    for i, op in enumerate(ops):
        _str(op, f"splitting_ops[{i}]", OP_RE, '"namespace::op" or "namespace::op.overload"')
        if op in ops[:i]:
            raise Invalid(f"splitting_ops[{i}]", f"duplicate op {op!r}")
    return tuple(sorted(ops))


def _inductor(v: Any) -> FrozenMap:
    if not isinstance(v, Mapping):
        raise Invalid("inductor", f"expected a mapping of Inductor config patches, got {_show(v)}")
    for k in v:
        _str(k, _join("inductor", str(k)), DOTTED_RE, "an Inductor config name like 'max_autotune'")
    return _json(v, "inductor")


def _model(d: Any, base: Path) -> ModelSpec:
    _keys(d, "model", (), ("factory", "hf", "kwargs", "weights", "seed", "output"))
    factory, hf = d.get("factory"), d.get("hf")
    if (factory is None) == (hf is None):
        got = "both" if factory is not None else "neither"
        raise Invalid("model", f"expected exactly one of 'factory' (\"pkg.module:fn\" or "
                                f"\"path/to/file.py:fn\") or 'hf' (a transformers architecture), got {got}")
    spec: dict[str, Any] = {}
    if factory is not None:
        fmt = '"pkg.module:fn" or "path/to/file.py:fn"'
        s = _str(factory, "model.factory", what=fmt)
        target, _, fn = s.rpartition(":")
        if not target or not DOTTED_RE.fullmatch(fn):
            raise Invalid("model.factory", f"expected {fmt}, got {s!r}")
        if target.endswith(".py") or "/" in target or "\\" in target:
            file = _resolve(base, target)
            if file.suffix != ".py" or not file.is_file():
                raise Invalid("model.factory", f"expected {fmt}; no Python file at {file}")
            spec.update(factory_file=file)
        elif DOTTED_RE.fullmatch(target):
            spec.update(factory_module=target)
        else:
            raise Invalid("model.factory", f"expected {fmt}, got {s!r}")
        spec.update(factory=s, factory_fn=fn)
    else:
        spec["hf"] = _hf(hf, base)
    kwargs = d.get("kwargs", {})
    if not isinstance(kwargs, Mapping):
        raise Invalid("model.kwargs", f"expected a mapping, got {_show(kwargs)}")
    weights = _str(d.get("weights", "random"), "model.weights",
                   what="'random', a .safetensors file or a model directory")
    if weights != "random":
        wp = _resolve(base, weights)
        if wp.suffix in PICKLE_SUFFIXES or (wp.is_file() and wp.suffix != ".safetensors"):
            raise Invalid("model.weights", f"expected 'random', a .safetensors file or a model directory, "
                                            f"got {weights!r} (convert pickle checkpoints to .safetensors)")
        spec["weights_path"] = wp
    output = d.get("output")
    if isinstance(output, (list, tuple)):
        if not output:
            raise Invalid("model.output", "expected a non-empty list of attribute names / int indices")
        output = tuple(_output(o, f"model.output[{i}]") for i, o in enumerate(output))
    elif output is not None:
        output = _output(output, "model.output")
    return ModelSpec(kwargs=_json(kwargs, "model.kwargs"), weights=weights,
                     seed=_int(d.get("seed", 0), "model.seed", 0), output=output, **spec)


def _output(v: Any, path: str) -> str | int:
    if (isinstance(v, str) and IDENT_RE.fullmatch(v)) or (isinstance(v, int) and not isinstance(v, bool)):
        return v
    raise Invalid(path, f"expected an attribute name or an int index, got {_show(v)}")


def _tolerance(tol: Any, dtype: str) -> Tolerance:
    """The numeric check's tolerance; unset fields default by dtype (``DEFAULT_TOLERANCE``)."""
    atol, rtol = DEFAULT_TOLERANCE[dtype]
    t = _keys(tol, "tolerance", (), ("atol", "rtol"))
    return Tolerance(_num(t.get("atol", atol), "tolerance.atol", 0),
                     _num(t.get("rtol", rtol), "tolerance.rtol", 0))


def _hf(d: Any, base: Path) -> HFSpec:
    _keys(d, "model.hf", ("architecture", "config"), ())
    arch = _str(d["architecture"], "model.hf.architecture", IDENT_RE,
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
        raise Invalid(where, f"config file not found: {f}") from None
    except (OSError, UnicodeDecodeError, ValueError) as e:
        raise Invalid(where, f"cannot read {f} as JSON: {' '.join(str(e).split())}") from None
    if not isinstance(loaded, dict):
        raise Invalid(where, f"{f} must hold a JSON object, got {_show(loaded)}")
    return HFSpec(arch, _json(loaded, where), config_path=cfg, config_file=f)


def _inputs(v: Any) -> tuple[InputSpec, ...]:
    if not _seq(v, "inputs"):
        raise Invalid("inputs", "expected a non-empty list of inputs (the forward's arguments in order)")
    specs: list[InputSpec] = []
    for i, x in enumerate(v):
        p = f"inputs[{i}]"
        _keys(x, p, ("name", "dtype", "shape"), ("fill", "low", "high"))
        name = _str(x["name"], f"{p}.name", IDENT_RE, "a Python identifier")
        if any(s.name == name for s in specs):
            raise Invalid(f"{p}.name", f"duplicate input name {name!r}")
        dtype = _choice(x["dtype"], f"{p}.dtype", INPUT_DTYPES)
        shape: list[int | str] = []
        for j, dim in enumerate(_seq(x["shape"], f"{p}.shape")):
            if dim == TOKENS and TOKENS in shape:
                raise Invalid(f"{p}.shape[{j}]", "a second 'tokens' dim; an input has at most one")
            shape.append(dim if dim == TOKENS else
                         _int(dim, f"{p}.shape[{j}]", 1, "a positive int or 'tokens'"))
        fill = _choice(x.get("fill", "random"), f"{p}.fill", FILLS)
        low, high = x.get("low", 0), x.get("high")
        if fill != "random" or dtype == "bool":
            why = f"fill: {fill}" if fill != "random" else "dtype: bool"
            if high is not None:
                raise Invalid(f"{p}.high", f"not used with {why}; remove it")
            if fill == "arange" and dtype != "bool":  # low: the first value (positions + k)
                low = _int(low, f"{p}.low", what="an int (the first value of the arange)")
            elif isinstance(low, bool) or low != 0:
                raise Invalid(f"{p}.low", f"not used with {why}; remove it")
            else:
                low = 0
        elif dtype.startswith(("float", "bfloat")):
            low = _num(low, f"{p}.low")
            high = None if high is None else _num(high, f"{p}.high")
        else:
            low = _int(low, f"{p}.low")
            if high is None:
                raise Invalid(f"{p}.high", f"required for a random {dtype} input: the exclusive "
                                            "upper bound (e.g. the vocab size)")
            high = _int(high, f"{p}.high")
            lo, hi = _INT_RANGES[dtype]
            for key, val in (("low", low), ("high", high)):
                if not lo <= val <= hi:
                    raise Invalid(f"{p}.{key}", f"expected an int in [{lo}, {hi}] for {dtype}, got {val}")
        if high is not None and high <= low:
            raise Invalid(f"{p}.high", f"expected a value greater than low ({low}), got {_show(high)}")
        specs.append(InputSpec(name, dtype, tuple(shape), fill, low, high))
    if not any(s.token_dim is not None for s in specs):
        raise Invalid("inputs", "no input has a 'tokens' dim; mark the token dim of at least one "
                                 "input's shape with 'tokens'")
    return tuple(specs)
