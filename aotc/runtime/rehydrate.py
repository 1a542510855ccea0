"""Artifacts on disk → callables: each compiled piece's fast-path record through
:mod:`aotc._torch.wrapper` (no Inductor import), the rest through ``CompiledArtifact.load``. Shared by the
loader and by the compile step's numeric check, so the check runs exactly what the loader will."""

from __future__ import annotations

import pickle
from pathlib import Path
from typing import Any

from aotc._torch import compiler, training_path, wrapper
from aotc.counters import COUNTERS
from aotc.errors import LoadError
from aotc.records.program import Program


def rehydrate(program: Program, files: dict[str, Path], kernel_root: Path,
              options: dict[str, Any] | None, fast: bool = True) -> dict[str, dict[int | None, Any]]:
    """Callables of every artifact of ``program`` by unique piece and size (None = dynamic).

    ``files`` maps blob roles to files on disk (the artifacts, or their fast-path records when
    ``fast``); ``kernel_root`` holds the kernel libraries at their recorded relative paths.
    """
    by_uid: dict[str, dict[int | None, Any]] = {}
    slow = []
    for a in program.artifacts:
        if fast and a.wrapper_role:
            try:
                data = files[a.wrapper_role].read_bytes()
                fn = training_path.load(data, kernel_root) if training_path.is_training_record(data) \
                    else wrapper.load(wrapper.WrapperCode.from_json(data), kernel_root)
            except (ValueError, KeyError, TypeError, AttributeError, ImportError, OSError, SyntaxError,
                    pickle.UnpicklingError) as e:
                raise LoadError(f"fast-path record {a.wrapper_role} cannot be loaded "
                                f"({type(e).__name__}: {e}); set AOTC_LOADER=inductor to load "
                                "through Inductor, or recompile") from e
            by_uid.setdefault(a.uid, {})[a.size] = fn
            COUNTERS.loads += 1
            COUNTERS.fast_loads += 1
        else:
            slow.append(a)
    if slow:
        loaded = compiler.load([files[a.role] for a in slow], kernel_root, options)
        for a, fn in zip(slow, loaded):
            by_uid.setdefault(a.uid, {})[a.size] = fn
    return by_uid
