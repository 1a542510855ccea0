"""The compile journey: build → one Dynamo capture → split at the splitting ops → compile each
unique piece for every shape → check against eager → store (``aotc.compile``).

``aotc.compile`` is both this package and the public function: importing a module of the
package makes ``aotc.compile`` this package, which stays callable with the function's signature.
"""

from __future__ import annotations

import sys
import types
from typing import Any


class _CallablePackage(types.ModuleType):
    def __call__(self, manifest: Any, store: Any = None, **kwargs: Any) -> Any:
        """Compile the model a manifest names and store the program; see
        :func:`aotc.compile.pipeline.compile_manifest`."""
        from aotc.compile.pipeline import compile_manifest

        return compile_manifest(manifest, store=store, **kwargs)


sys.modules[__name__].__class__ = _CallablePackage
