"""Cache keys: factors → canonical JSON → sha256, and ``explain`` to diff two factor trees.

Canonical JSON: sorted keys, no whitespace, UTF-8; floats are written as ``{"$float": repr}`` so
``1.0`` and ``1`` never collide and no float is left to a serializer's rounding; a type that has no
canonical form (a tensor, a set, a path object, NaN) is a ``TypeError`` — never skipped, because a
factor dropped from the key is a wrong artifact handed back later.
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

FORMAT_VERSION = 2  # bump when the Program record or the artifact layout changes


def _canon(value: Any, path: str) -> Any:
    if value is None or isinstance(value, (bool, str)):
        return value
    if isinstance(value, int):
        return value
    if isinstance(value, float):
        if not math.isfinite(value):
            raise TypeError(f"key factor {path}: non-finite float {value!r} has no canonical form")
        return {"$float": repr(value)}
    if isinstance(value, Mapping):
        out = {}
        for k, v in value.items():
            if not isinstance(k, str):
                raise TypeError(f"key factor {path}: mapping key {k!r} is not a string")
            out[k] = _canon(v, f"{path}.{k}")
        return out
    if isinstance(value, (list, tuple)):
        return [_canon(v, f"{path}[{i}]") for i, v in enumerate(value)]
    raise TypeError(f"key factor {path}: unsupported type {type(value).__name__} ({value!r:.60})")


def canonical_json(factors: Mapping[str, Any]) -> str:
    """The one serialization keys are hashed from (raises ``TypeError`` on unsupported types)."""
    return json.dumps(_canon(factors, "factors"), sort_keys=True, separators=(",", ":"),
                      ensure_ascii=False)


def compute_key(factors: Mapping[str, Any]) -> str:
    """sha256 hex of the canonical JSON of ``factors``."""
    return hashlib.sha256(canonical_json(factors).encode("utf-8")).hexdigest()


@dataclass(frozen=True)
class FactorDiff:
    """One field that differs between two factor trees (``None`` side = absent)."""

    path: str
    stored: Any
    current: Any

    def describe(self) -> str:
        def show(v: Any) -> str:
            text = json.dumps(v, sort_keys=True) if v is not None else "(absent)"
            return text if len(text) <= 80 else text[:77] + "..."

        return f"{self.path}: {show(self.stored)} -> {show(self.current)}"


def explain(stored: Mapping[str, Any], current: Mapping[str, Any]) -> list[FactorDiff]:
    """Every leaf that differs between two factor trees, by dotted path, sorted."""
    diffs: list[FactorDiff] = []

    def walk(a: Any, b: Any, path: str) -> None:
        if isinstance(a, Mapping) and isinstance(b, Mapping):
            for k in sorted(set(a) | set(b)):
                walk(a.get(k), b.get(k), f"{path}.{k}" if path else k)
        elif a != b:
            diffs.append(FactorDiff(path, a, b))

    walk(_plain(stored), _plain(current), "")
    return diffs


def _plain(value: Any) -> Any:
    return json.loads(json.dumps(value, sort_keys=True, default=str))
