"""aotc: ahead-of-time compile-and-cache for PyTorch model serving.

Importing ``aotc`` is cheap: torch is only imported when ``aotc.compile`` or ``aotc.load`` is used,
so the store commands (``aotc inspect``, ``verify``, ``gc``) answer without loading torch.
"""

from __future__ import annotations

from typing import Any

__version__ = "0.1.0"
__all__ = ["backend", "compile", "load", "__version__"]


def compile(manifest: Any, store: Any = None, **kwargs: Any) -> Any:  # noqa: A001 - public API name
    """Compile the model a manifest names and store the program; see ``aotc.compile.pipeline.compile_manifest``."""
    from aotc.compile.pipeline import compile_manifest

    return compile_manifest(manifest, store=store, **kwargs)


def backend(**kwargs: Any) -> Any:
    """A configured ``torch.compile`` backend; see ``aotc.backend.backend``. (Importing
    ``aotc.backend`` replaces this function by the package, which is callable the same way.)"""
    from aotc.backend import backend as _backend

    return _backend(**kwargs)


def load(manifest_or_key: Any, model: Any = None, store: Any = None, **kwargs: Any) -> Any:
    """Warm-start a stored program into a runnable; see ``aotc.runtime.loader.load``."""
    from aotc.runtime.loader import load as _load

    return _load(manifest_or_key, model=model, store=store, **kwargs)
