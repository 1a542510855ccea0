"""What the backend returns to Dynamo: :class:`AotcCompiled`, a torch ``SerializableCallable``.

torch's AOT path (``torch.compile(...).aot_compile``, vLLM's ``VLLM_USE_AOT_COMPILE``) saves a
backend's result with ``serialize_compile_artifacts``: ours writes only the store key (and the
store/remote the backend was given explicitly), ~100 bytes. A later start loads that file
without Dynamo and without calling the backend; ``deserialize_compile_artifacts`` gives an
unloaded callable and ``finalize_loading`` (vLLM calls it right after loading; otherwise the
first call does) fetches the program from the store — pulling it from the remote on a local
miss — and rehydrates it. An entry that is gone raises there, so vLLM falls back to a clean
compile rather than running something else.
"""

from __future__ import annotations

import json
import threading
import time
from typing import Any

from aotc._torch import dynamo
from aotc.counters import COUNTERS
from aotc.errors import LoadError
from aotc.runtime.graphcall import GraphRunner
from aotc.runtime.stitched import Timings

__all__ = ["AotcCompiled", "load_graph_program"]

_FORMAT = 1


def load_graph_program(key: str, store: Any = None, remote: Any = None, trust: Any = (),
                       timings: Timings | None = None) -> GraphRunner:
    """The stored program of a graph by its key, ready to call, from the tiered store
    (:mod:`aotc.fleet.tiered`): ``store`` (a ``TieredStore``, or what ``open_tiered`` takes;
    default ``AOTC_STORE``), pulled through from ``remote`` (``AOTC_REMOTE``) on a local miss,
    verified; trust policy enforced."""
    from aotc.fleet.tiered import TieredStore, open_tiered
    from aotc.fleet.trust import trust_policy
    from aotc.runtime.loader import rehydrate_entry
    from aotc.settings import current

    timings = timings or Timings()
    if isinstance(store, TieredStore):
        tiered = store
    else:
        settings = current()
        tiered = open_tiered(store, remote, trust_policy(trust, settings), settings)
    before, t = tiered.pulled_bytes, time.perf_counter()
    entry = tiered.get(key, miss_hint=f"the store {tiered.local.root} has no entry {key[:16]}… for "
                                      "this graph (compiled on another machine? set AOTC_REMOTE to pull it)")
    if tiered.pulled_bytes > before:
        timings.pulled_bytes = tiered.pulled_bytes - before
        timings.add("pull", time.perf_counter() - t)
    _check_machine(entry, tiered.local)
    COUNTERS.cache_hits += 1
    program, by_uid = rehydrate_entry(entry, tiered.local, timings,
                                      entry.factors.get("inductor", {}).get("patches", {}), tiered.trusted)
    return GraphRunner(program, by_uid, key=key, timings=timings)


def _check_machine(entry: Any, store: Any) -> None:
    """An entry loaded by key alone (a saved AOT record) must have been built for this machine:
    the same toolchain (compiler, CPU ISA or GPU, torch) and aotc compile logic. Otherwise a
    ``LoadError``, and a framework that saved the record (vLLM) compiles again."""
    from aotc.lookup.compile_logic import compile_logic_hash
    from aotc.lookup.toolchain import machine_factors

    device = str(entry.metadata.get("device") or "cpu")
    mine = machine_factors(device, store.base / "toolchain")["toolchain"]
    theirs = entry.factors.get("toolchain")
    logic = (entry.factors.get("aotc") or {}).get("compile_logic")
    if theirs != mine:
        differ = sorted(k for k in set(mine) | set(theirs or {}) if (theirs or {}).get(k) != mine.get(k))
        raise LoadError(f"stored graph {entry.key[:16]}… was built for another machine (toolchain "
                        f"differs in {', '.join(differ[:4])}); compile it here")
    if logic != compile_logic_hash():
        raise LoadError(f"stored graph {entry.key[:16]}… was built by another aotc version; "
                        "compile it again")


def _location(store: Any) -> str | None:
    """A store as the saved record names it: an absolute directory or a remote's URL
    (``s3://``, ``oci://``)."""
    from aotc.settings import is_remote_url

    if store is None:
        return None
    root = getattr(store, "root", store)
    text = str(getattr(root, "url", root))
    if is_remote_url(text):
        return text
    from pathlib import Path

    return str(Path(text).expanduser().resolve())


class AotcCompiled(dynamo.serializable_callable_base()):  # type: ignore[misc]  # the base class is torch's, found at run time
    """The stitched program of one graph, by store key (module doc). ``runner`` is None until
    loaded; ``store``/``remote``/``trust``: what the backend was given explicitly (None: the
    settings of the process that loads it)."""

    def __init__(self, key: str, runner: GraphRunner | None = None, store: Any = None,
                 remote: Any = None, trust: tuple[str, ...] = ()) -> None:
        self.key, self.runner = key, runner
        self.store = _location(store)
        self.remote = None if remote is None else str(getattr(remote, "url", remote))
        self.trust = tuple(trust)
        self._lock = threading.Lock()

    @classmethod
    def serialize_compile_artifacts(cls, fn: AotcCompiled) -> bytes:
        """The key and explicit locations, as JSON (the artifacts stay in the store)."""
        return json.dumps({"aotc": _FORMAT, "key": fn.key, "store": fn.store, "remote": fn.remote,
                           "trust": list(fn.trust)}, sort_keys=True).encode()

    @classmethod
    def deserialize_compile_artifacts(cls, data: bytes) -> AotcCompiled:
        """An unloaded callable for the saved key; ``finalize_loading`` or the first call loads it."""
        try:
            d = json.loads(data)
            if d.get("aotc") != _FORMAT:
                raise ValueError(f"format {d.get('aotc')!r}, this aotc reads {_FORMAT}")
            return cls(str(d["key"]), store=d.get("store"), remote=d.get("remote"),
                       trust=tuple(d.get("trust") or ()))
        except (ValueError, KeyError, TypeError) as e:
            raise LoadError(f"saved aotc compiled function is unreadable ({e}); delete the "
                            "framework's compile cache and start again") from e

    def finalize_loading(self, *_config: Any) -> None:
        """Fetch and rehydrate the program now (vLLM calls this after loading its AOT file)."""
        self._ensure()

    def _ensure(self) -> GraphRunner:
        if self.runner is None:
            with self._lock:
                if self.runner is None:
                    self.runner = load_graph_program(self.key, self.store, self.remote, self.trust)
        return self.runner

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        runner = self.runner or self._ensure()
        return runner(*args, **kwargs)

    def __getstate__(self) -> dict[str, Any]:  # pickled by reference: the key, never the kernels
        return {"key": self.key, "store": self.store, "remote": self.remote, "trust": self.trust}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(state["key"], store=state["store"], remote=state["remote"],  # type: ignore[misc]  # re-initialised in place: unpickling by reference
                      trust=tuple(state["trust"]))

    def __repr__(self) -> str:
        return f"AotcCompiled(key={self.key[:16]}…, loaded={self.runner is not None})"
