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
from aotc.errors import BackendError, LoadError
from aotc.runtime.graphcall import GraphRunner
from aotc.runtime.stitched import Timings

__all__ = ["AotcCompiled", "load_graph_program"]

_FORMAT = 1


def load_graph_program(key: str, context: Any, timings: Timings | None = None) -> GraphRunner:
    """The stored program of a graph by its key alone (a saved record), ready to call: from the
    ``context``'s tiered store (pulled through on a local miss, verified, trust policy
    enforced), checked to be built for this machine and this aotc."""
    tiered = context.open_tiered()
    before, t = tiered.pulled_bytes, time.perf_counter()
    entry = tiered.get(key, miss_hint=f"the store {tiered.local.root} has no entry {key[:16]}… for "
                                      "this graph (compiled on another machine? set AOTC_REMOTE to pull it)",
                       built_here=True)  # a key from elsewhere: built for this machine?
    timings = timings or Timings()
    if tiered.pulled_bytes > before:
        timings.pulled_bytes = tiered.pulled_bytes - before
        timings.add("pull", time.perf_counter() - t)
    fast = context.loader != "inductor"
    return runner_of(entry, tiered, fast, timings)


def runner_of(entry: Any, tiered: Any, fast: bool, timings: Timings | None = None) -> GraphRunner:
    """A graph entry the ``tiered`` store handed out (trust-checked there), rehydrated."""
    from aotc.runtime.loader import rehydrate_entry

    timings = timings or Timings()
    COUNTERS.cache_hits += 1
    program, by_uid = rehydrate_entry(entry, tiered.local, timings,
                                      entry.factors.get("inductor", {}).get("patches", {}),
                                      fast)
    return GraphRunner(program, by_uid, key=entry.key, timings=timings)


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
    loaded; ``store``: the store the backend was given explicitly (None: ``AOTC_STORE`` of the
    process that loads it). The saved form holds the key and that store only: the remote and
    the trust policy of a load are the loading process's operator's (``AOTC_REMOTE``,
    ``AOTC_TRUST_KEYS``), never the saved data's."""

    def __init__(self, key: str, runner: GraphRunner | None = None, store: Any = None,
                 extra_inputs: tuple[Any, ...] = ()) -> None:
        self.key, self.runner = key, runner
        self.store = _location(store)
        self.extra_inputs = extra_inputs  # the traced module's tensors the graph reads (graph_inputs)
        self._lock = threading.Lock()

    @classmethod
    def serialize_compile_artifacts(cls, fn: AotcCompiled) -> bytes:
        """The key and the explicit store, as JSON (the artifacts stay in the store). A graph
        that reads tensors of the traced module (``extra_inputs``) cannot be saved so."""
        if fn.extra_inputs:
            raise BackendError(f"graph {fn.key[:16]}… reads {len(fn.extra_inputs)} tensors of the "
                               "traced module (an optimizer's state); a saved function cannot "
                               "carry them: compile it in the serving process instead")
        return json.dumps({"aotc": _FORMAT, "key": fn.key, "store": fn.store},
                          sort_keys=True).encode()

    @classmethod
    def deserialize_compile_artifacts(cls, data: bytes) -> AotcCompiled:
        """An unloaded callable for the saved key; ``finalize_loading`` or the first call loads
        it. A record's other fields (older records saved a remote and trusted keys) are ignored:
        data never widens trust or redirects pulls."""
        try:
            d = json.loads(data)
            if d.get("aotc") != _FORMAT:
                raise ValueError(f"format {d.get('aotc')!r}, this aotc reads {_FORMAT}")
            return cls(str(d["key"]), store=d.get("store"))
        except (ValueError, KeyError, TypeError) as e:
            raise LoadError(f"saved aotc compiled function is unreadable ({e}); delete the "
                            "framework's compile cache and start again") from e

    def load_with(self, context: Any) -> GraphRunner:
        """Fetch and rehydrate the program now through ``context`` (the caller's entry point:
        a precompiled function being loaded), unless already loaded."""
        with self._lock:
            if self.runner is None:
                self.runner = load_graph_program(self.key, context)
        return self.runner

    def finalize_loading(self, *_config: Any) -> None:
        """Fetch and rehydrate the program now (vLLM calls this after loading its AOT file)."""
        self._ensure()

    def _ensure(self) -> GraphRunner:
        if self.runner is None:
            with self._lock:
                if self.runner is None:  # an entry point: the loading process's own context
                    from aotc.context import Context
                    from aotc.settings import is_remote_url

                    # a saved local store is kept; a saved remote URL is not (data never redirects pulls)
                    store = None if is_remote_url(self.store) else self.store
                    self.runner = load_graph_program(self.key, Context.from_env(store=store))
        return self.runner

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        runner = self.runner or self._ensure()
        if self.extra_inputs:
            return runner(*args, *self.extra_inputs, **kwargs)
        return runner(*args, **kwargs)

    def __getstate__(self) -> dict[str, Any]:  # pickled by reference: the key, never the kernels
        return {"key": self.key, "store": self.store}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(state["key"], store=state.get("store"))  # type: ignore[misc]  # re-initialised in place: unpickling by reference

    def __repr__(self) -> str:
        return f"AotcCompiled(key={self.key[:16]}…, loaded={self.runner is not None})"
