"""Parse and validate ``model.yaml`` into a frozen :class:`Manifest` (pyyaml + stdlib only; no torch).

Every problem raises ``ManifestError(file, field_path, problem)``, one line, e.g.
``manifests/x.yaml: capture_sizes[2]: expected a positive int, got '8x'``. Unknown keys are errors,
``bool`` is never an int, relative paths resolve against the manifest's directory. Floats such as
``1e-4`` are read as numbers (YAML 1.2 style; plain PyYAML would read them as strings).
Schema and defaults: see ``manifests/toy-llama.yaml`` and :mod:`aotc.manifest.schema`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import os
import sys
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

from aotc.errors import ManifestError
from aotc.manifest.schema import (  # noqa: F401 - the package's public names
    _REVALIDATE,
    CUDAGRAPH_MODES,
    DEFAULT_TOLERANCE,
    DEVICES,
    DTYPES,
    FILLS,
    INPUT_DTYPES,
    TOKENS,
    FrozenMap,
    HFSpec,
    InputSpec,
    Manifest,
    ModelSpec,
    Tolerance,
    thaw,
)
from aotc.manifest.validate import Invalid, validate
from aotc.manifest.yamlio import load_yaml

__all__ = [
    "Manifest", "ModelSpec", "HFSpec", "InputSpec", "Tolerance", "FrozenMap", "thaw",
    "load_manifest", "parse_manifest", "factory_path",
    "DTYPES", "INPUT_DTYPES", "DEVICES", "FILLS", "CUDAGRAPH_MODES", "TOKENS", "DEFAULT_TOLERANCE",
]


@contextlib.contextmanager
def factory_path(manifest: Manifest) -> Iterator[None]:
    """While building the model (and while locating the sources it traced): the directory of a
    factory given as ``path/to/model.py:fn`` on ``sys.path``, so the file can import its
    sibling modules, at compile and at load alike."""
    f = manifest.model.factory_file
    d = str(Path(f).parent) if f is not None else None
    if d is None or d in sys.path:
        yield
        return
    sys.path.insert(0, d)
    try:
        yield
    finally:
        with contextlib.suppress(ValueError):
            sys.path.remove(d)



# ---------------------------------------------------------------- public entry points


def read_manifest_yaml(path: str | os.PathLike[str]) -> Any:
    """The YAML document of a manifest file, read as safely as :func:`load_manifest` reads it
    (UTF-8 only, alias bombs refused); a ``ManifestError`` for anything unreadable."""
    file, p = os.fspath(path), Path(path)
    try:
        text = p.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise ManifestError(file, "", f"not UTF-8 text ({e.reason} at byte {e.start})") from None
    except OSError as e:
        why = {errno.ENOENT: "no such file", errno.EISDIR: "is a directory"}.get(
            e.errno or 0, f"cannot read it: {e.strerror}")
        raise ManifestError(file, "", f"{why}; pass the path of a model.yaml manifest") from None
    return load_yaml(text, file)


def load_manifest(path: str | os.PathLike[str]) -> Manifest:
    """Read, parse and validate the manifest file at ``path``; relative paths in it resolve
    against its directory. Raises ``ManifestError`` (missing file, bad YAML, invalid field)."""
    file, p = os.fspath(path), Path(path)
    data = read_manifest_yaml(path)
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
        return validate(data, base)
    except Invalid as e:
        raise ManifestError(file, e.field, e.problem) from None


_REVALIDATE.append(parse_manifest)
