"""The manifest as data: frozen dataclasses, the allowed values, the patterns names must match
(pyyaml-free, torch-free). Parsing and validation are in :mod:`aotc.manifest.validate`."""

from __future__ import annotations

import dataclasses
import os
import re
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

__all__ = [
    "Manifest", "ModelSpec", "HFSpec", "InputSpec", "Tolerance", "FrozenMap", "thaw",
    "DTYPES", "INPUT_DTYPES", "DEVICES", "FILLS", "CUDAGRAPH_MODES", "TOKENS", "DEFAULT_TOLERANCE",
    "NAME_RE", "CLASS_RE", "IDENT_RE", "DOTTED_RE", "OP_RE", "PICKLE_SUFFIXES",
]

# How Manifest.replace re-validates: set by aotc.manifest to its parse_manifest (the schema
# does not import the validator, which imports the schema).
_REVALIDATE: list[Callable[..., Manifest]] = []

DTYPES = ("float32", "float16", "bfloat16")
INPUT_DTYPES = ("int64", "int32", "float32", "float16", "bfloat16", "bool")
DEVICES = ("cpu", "cuda")
FILLS = ("random", "arange", "zeros", "ones")
CUDAGRAPH_MODES = ("none", "piecewise", "full")
TOKENS = "tokens"  # the shape entry that marks an input's token (dynamic) dim
# (atol, rtol) of the compile-time check when the manifest gives none: compiled and eager
# kernels round differently, by about the dtype's epsilon times the depth of the computation
DEFAULT_TOLERANCE = {"float32": (1e-4, 1e-4), "float16": (1e-2, 1e-2), "bfloat16": (3e-2, 3e-2)}

NAME_RE = re.compile(r"[A-Za-z0-9._-]+")
CLASS_RE = re.compile(r"[A-Za-z_][A-Za-z0-9_]*(?:\.[A-Za-z_][A-Za-z0-9_]*)*")
IDENT_RE = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
DOTTED_RE = re.compile(r"[A-Za-z_][A-Za-z0-9_]*(?:\.[A-Za-z_][A-Za-z0-9_]*)*")
OP_RE = re.compile(r"[A-Za-z_][A-Za-z0-9_]*::[A-Za-z_][A-Za-z0-9_]*(?:\.[A-Za-z_][A-Za-z0-9_]*)?")
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl")


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
    output: str | int | tuple[str | int, ...] | None = None  # field(s) / index(es) to return


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
    regions: str | tuple[str, ...] = "auto"  # "auto", "off" or class names (sorted)
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
            "regions": self.regions if isinstance(self.regions, str) else list(self.regions),
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
        return dataclasses.replace(_REVALIDATE[0](data, file, base_dir), path=path)


def _model_dict(m: ModelSpec) -> dict[str, Any]:
    hf = None
    if m.hf is not None:
        cfg = m.hf.config_path if m.hf.config_path is not None else thaw(m.hf.config)
        hf = {"architecture": m.hf.architecture, "config": cfg}
    return {"factory": m.factory, "hf": hf, "kwargs": thaw(m.kwargs), "weights": m.weights,
            "seed": m.seed, "output": list(m.output) if isinstance(m.output, tuple) else m.output}


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
