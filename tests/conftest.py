"""Shared fixtures. Compiled fixtures are session-scoped: one store, each model compiled once."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
HELPERS = ROOT / "tests" / "helpers"


@pytest.fixture
def store(tmp_path: Path):
    """A fresh, empty store in a temp dir (real sqlite, real zstd)."""
    from aotc.cache import Store

    s = Store(tmp_path / "store")
    yield s
    s.close()


def python_env() -> dict[str, str]:
    """Environment for subprocesses: this interpreter's packages, no inherited AOTC_STORE."""
    env = dict(os.environ)
    env.pop("AOTC_STORE", None)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH", "")]))
    return env


PYTHON = sys.executable
