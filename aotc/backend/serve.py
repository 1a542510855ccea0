"""aotc as a ``torch.compile`` backend: ``torch.compile(model, backend="aotc")`` (registered through
torch's ``torch_dynamo_backends`` entry point) or ``backend=aotc.backend(store=…, …)``.

Dynamo hands the backend one graph. Its key is the graph's canonical form
(:mod:`aotc.backend.graphkey`) + toolchain + Inductor settings + aotc's format and compile logic +
splitting ops + compile sizes. A stored entry (or one pulled from the remote, verified) is
rehydrated through the no-Inductor fast path; a miss compiles, checks and stores it
(:mod:`aotc.backend.build`) and pushes it when a remote is set. Either way Dynamo gets an
:class:`~aotc.backend.compiled.AotcCompiled`, which torch's and vLLM's AOT paths can save as
just the key. (The opt-in merged programs — a split CPU graph compiled whole in a forked child
and served instead of its pieces — were removed: docs/decisions.md, 2026-12-06.)

A graph traced with grad on whose inputs (the weights) require grad is compiled for training:
each piece's forward and backward (AOTAutograd's), both stored; the check compares gradients as
well as outputs; the program runs under the caller's grad mode. Any other graph is compiled for
inference and runs under ``no_grad``. It reports through the ``aotc.backend`` logger (:mod:`aotc.log`): one INFO line
per graph, one WARNING line per fallback or failed push.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from aotc.backend.config import DEFAULT_SPLITTING_OPS, BackendConfig
from aotc.gc_pause import gc_paused
from aotc.log import logger

_log = logger("backend")

__all__ = ["DEFAULT_SPLITTING_OPS", "AotcBackend", "aotc_backend", "backend", "backend_key", "start_kernel_header"]


def backend_key(gm: Any, example_inputs: Sequence[Any], config: BackendConfig | None = None,
                store: Any = None, settings: Any = None) -> tuple[str, dict[str, Any]]:
    """``(key, factors)`` of a graph as the backend would store it under ``config`` as a call
    applies it (:meth:`BackendConfig.with_env`, :meth:`BackendConfig.on_device`; ``store``:
    where the toolchain memo lives; ``settings``: the entry point's, for the splitting ops and
    compile sizes the environment names — default: read now, for callers that are entry points)."""
    from aotc._torch import inductor_facts
    from aotc.backend.graphkey import graph_device, graph_factors
    from aotc.lookup.compile_logic import compile_logic_hash
    from aotc.lookup.resolve import inductor_factors
    from aotc.lookup.toolchain import machine_factors
    from aotc.records.key import FORMAT_VERSION, compute_key
    from aotc.settings import Settings

    config = config or BackendConfig()
    settings = settings or Settings.from_env()
    device = graph_device(example_inputs)
    memo = None if store is None else store.base / "toolchain"
    machine = machine_factors(device, memo)
    factors = {
        "graph": graph_factors(gm, example_inputs),
        "toolchain": machine["toolchain"],
        # live values: a framework may patch Inductor's config around the compile (vLLM does)
        "inductor": inductor_factors(dict(config.inductor), inductor_facts.config_values(), device),
        "global": machine["global"],  # torch's process-wide settings (aotc._torch.global_factors)
        "aotc": {"format": FORMAT_VERSION, "compile_logic": compile_logic_hash(), "kind": "graph"},
        "backend": {"splitting_ops": sorted(config.ops(settings)),
                    "compile_sizes": list(config.sizes(settings))},
    }
    return compute_key(factors), factors


class AotcBackend:
    """A configured backend: ``torch.compile(m, backend=AotcBackend(...))`` (see module doc)."""

    def __init__(self, config: BackendConfig) -> None:
        self.config = config
        if isinstance(config.store, (str, os.PathLike)) and "://" not in str(config.store):
            _STORES.add(str(config.store))
        self.last: dict[str, Any] = {}  # what the last call did (key, hit, seconds): for tests and logs

    def __repr__(self) -> str:
        return f"aotc.backend(store={self.config.store!r}, remote={self.config.remote!r})"

    def __call__(self, gm: Any, example_inputs: Sequence[Any], **kwargs: Any) -> Any:
        """Serve one graph Dynamo hands over (module doc). ``kwargs``: what ``torch.compile``
        passes (``mode=``, ``options=``). A graph aotc cannot serve falls back (``fallback``,
        ``AOTC_FALLBACK``: Inductor by default) with one warning line; a bad argument raises."""
        from aotc.backend.config import call_config
        from aotc.context import Context
        from aotc.errors import AotcError
        from aotc.log import configure
        from aotc.settings import Settings

        _arm()  # again after a torch._dynamo.reset(), for the next compile
        cfg = call_config(self.config, kwargs).with_env(os.environ)  # an entry point: read here
        try:  # this entry point's context: the environment, read once
            context = Context.from_env(store=cfg.store, remote=cfg.remote, trust=cfg.trust)
        except AotcError as e:  # a bad AOTC_* value (a trusted key, a number): one line, not a dead caller
            if cfg.fallback == "error":
                raise
            return self._fall_back(gm, example_inputs, cfg, Settings(), cfg.fallback or "inductor", e, "")
        configure(context.settings.log)
        policy = cfg.fallback_for(context.settings)
        seen: dict[str, Any] = {}  # the local store once open, the graph's key once computed
        try:
            with gc_paused():  # the key, split, compile, check and load make many objects (aotc.gc_pause)
                return self._serve(gm, example_inputs, cfg, context, seen)
        except Exception as e:  # noqa: BLE001 - the safety net: any failure serving this graph
            from aotc._torch.dynamo import is_restart
            from aotc.backend.given_up import remember

            if is_restart(e):
                raise
            remember(seen.get("store"), cfg.name, gm, example_inputs, seen.get("key", ""), e,
                     seen.get("tolerance"))
            if policy == "error":
                raise
            return self._fall_back(gm, example_inputs, cfg, context.settings, policy, e,
                                   seen.get("key", ""))

    def _fall_back(self, gm: Any, example_inputs: Sequence[Any], cfg: BackendConfig,
                   settings: Any, policy: str, error: BaseException, key: str) -> Any:
        """Serve the graph without aotc: Inductor's own compile, or the graph as it is (eager)."""
        from aotc.errors import one_line

        reason = one_line(error)
        graph = f"graph {key[:16]}…" if key else "a graph"
        _log.warning(f"aotc: warning: {graph} is not served by aotc ({reason}); {policy} runs it "
                     "instead (AOTC_FALLBACK=inductor|eager|error)")
        self.last = {"key": key, "hit": False, "fallback": policy, "reason": reason}
        if settings.report:
            self._report(settings, self.last)
        if policy == "eager":
            return gm.forward
        from aotc._torch.inductor_facts import inductor_compile

        return inductor_compile(gm, example_inputs, dict(cfg.inductor))

    def _serve(self, gm: Any, example_inputs: Sequence[Any], cfg: BackendConfig,
               context: Any, seen: dict[str, Any]) -> Any:
        """The stored program of this graph: local, pulled, or built here (the tiered store's
        one fleet journey, :meth:`aotc.fleet.tiered.TieredStore.get_or_build`)."""
        from aotc.backend.graphkey import graph_device, static_graph
        from aotc.compile.graph_inputs import flat_graph
        from aotc.fleet.tiered import Wanted

        t0 = time.perf_counter()
        settings = context.settings
        # regions inlined, tensors read by attribute made inputs (fed live by the callable)
        gm, example_inputs, extra = flat_graph(gm, example_inputs)
        if cfg.graphs and _on_cuda(example_inputs):
            _log.info("aotc: note: CUDA graphs (mode='reduce-overhead'/'max-autotune') are not "
                      "captured for torch.compile graphs yet; this graph runs without them")
        cfg = cfg.on_device(graph_device(example_inputs), static_graph(gm))
        tiered = context.open_tiered(create=True)
        seen["store"] = tiered.local
        key, factors = backend_key(gm, example_inputs, cfg, tiered.local, settings)
        seen["key"] = key

        def build_here() -> Any:
            from aotc.backend.build import computed_float_dtype
            from aotc.backend.given_up import raise_if_given_up

            # tried and failed before (with this tolerance): no split, compile or check again
            seen["tolerance"] = cfg.tolerance_for(computed_float_dtype(gm, example_inputs))
            raise_if_given_up(tiered.local, key, seen["tolerance"])
            return self._build(gm, example_inputs, key, factors, tiered, cfg, context, seen["tolerance"])

        pulled_before = tiered.pulled_bytes
        served = tiered.get_or_build(Wanted.by_key(key), build_here)
        if served.built is not None:
            meta = served.built.meta
            self._done(settings, {"key": key, "hit": False, "pulled": False, "pushed": served.pushed,
                                  "seconds": round(time.perf_counter() - t0, 3),
                                  "store": str(tiered.local.root), "pieces": meta["pieces"],
                                  "unique_pieces": meta["unique_pieces"], "compiles": meta["compiles"],
                                  "shared": meta.get("shared", 0), "numerics": meta["numerics"]})
            compiled = served.built.compiled
        else:
            compiled = self._load(served.entry, tiered, cfg, settings, t0, pulled=served.pulled,
                                  pulled_bytes=tiered.pulled_bytes - pulled_before)
        compiled.extra_inputs = extra
        return compiled

    def _load(self, entry: Any, tiered: Any, cfg: BackendConfig, settings: Any, t0: float,
              pulled: bool, pulled_bytes: int) -> Any:
        """The stored graph ``entry`` as Dynamo's callable."""
        from aotc._torch import dynamo
        from aotc.backend.compiled import AotcCompiled, runner_of

        with dynamo.outside_trace():
            runner = runner_of(entry, tiered, fast=settings.loader != "inductor")
        self._done(settings, {"key": entry.key, "hit": True, "pulled": pulled,
                              "pulled_bytes": pulled_bytes,
                              "seconds": round(time.perf_counter() - t0, 3),
                              "store": str(tiered.local.root)})
        return AotcCompiled(entry.key, runner, cfg.store)

    def _build(self, gm: Any, example_inputs: Sequence[Any], key: str, factors: dict[str, Any],
               tiered: Any, cfg: BackendConfig, context: Any, tolerance: tuple[float, float]) -> Any:
        """Compile the graph here with the check's ``tolerance`` (atol, rtol), store it (signed
        when a signing key is set) and load what was stored; the tiered store pushes it."""
        from aotc._torch import dynamo
        from aotc.backend.compiled import AotcCompiled, runner_of
        from aotc.backend.given_up import forget
        from aotc.cache import StoreReadOnlyError
        from aotc.errors import TrustError

        store, settings = tiered.local, context.settings  # (a bad AOTC_SIGNING_KEY failed opening it)
        if not tiered.can_sign:
            raise TrustError(f"graph {key[:16]}… is in neither the store nor the remote, and a trust "
                             "policy is set (AOTC_TRUST_KEYS / trust=): set AOTC_SIGNING_KEY to a "
                             "trusted key so this process signs what it compiles, or compile it "
                             "where it is signed and push it")
        if store.read_only:
            raise StoreReadOnlyError(str(store.root), f"compile graph {key[:16]}… into it")
        meta = _compile_and_store(gm, example_inputs, key, factors, store, cfg, context, tolerance)
        forget(store, key)
        with dynamo.outside_trace():
            runner = runner_of(store.get(key), tiered, fast=settings.loader != "inductor")
        return _Built(key, AotcCompiled(key, runner, cfg.store), meta)

    def _done(self, settings: Any, what: dict[str, Any]) -> None:
        """Remember, log (one INFO line) and report (``AOTC_REPORT``) what a call did."""
        self.last = what
        how = ("pulled from the remote" if what["pulled"] else "loaded from the store") if what["hit"] \
            else f"compiled {what['compiles']} pieces, checked, stored"
        _log.info(f"aotc: graph {what['key'][:16]}… {'hit' if what['hit'] else 'miss'}: {how} in "
                  f"{what['seconds']:.2f}s ({what['store']})")
        if settings.report:
            self._report(settings, what)

    @staticmethod
    def _report(settings: Any, what: dict[str, Any]) -> None:
        import json
        import os

        with open(settings.report, "a") as f:  # one short line per write: atomic append
            f.write(json.dumps({**what, "pid": os.getpid()}, sort_keys=True) + "\n")


def _compile_and_store(gm: Any, example_inputs: Sequence[Any], key: str, factors: dict[str, Any],
                       store: Any, cfg: BackendConfig, context: Any,
                       tolerance: tuple[float, float]) -> dict[str, Any]:
    """Split, compile, check and store the graph under ``key`` (:func:`aotc.backend.build.build_entry`),
    signed when the context has a signing key; the entry's metadata."""
    from aotc._torch import dynamo, header_build
    from aotc.backend.build import build_entry
    from aotc.progress import Progress

    settings, (atol, rtol) = context.settings, tolerance
    try:
        with dynamo.outside_trace():
            return build_entry(gm, example_inputs, store, key, factors, name=cfg.name,
                               ops=cfg.ops(settings), sizes=cfg.sizes(settings),
                               options=dict(cfg.inductor), atol=atol, rtol=rtol,
                               progress=Progress(), signer=context.signer)
    finally:  # the kernels' header build it started ends with this call (nothing left behind)
        header_build.wait_for_header_builds()


@dataclass(frozen=True)
class _Built:
    """A graph compiled and stored here: its key, the callable, the entry's metadata."""

    key: str
    compiled: Any
    meta: dict[str, Any]


def _on_cuda(example_inputs: Sequence[Any]) -> bool:
    return any(getattr(getattr(x, "device", None), "type", None) == "cuda" for x in example_inputs)


def backend(store: Any = None, remote: Any = None, trust: Iterable[str] | str = (),
            splitting_ops: Iterable[str] | str | None = None,
            compile_sizes: Iterable[int] | str | None = None, tolerance: Any = None,
            inductor: dict[str, Any] | None = None, name: str | None = None,
            mode: str | None = None, fallback: str | None = None,
            merge: Any = None) -> AotcBackend:
    """A configured ``torch.compile`` backend. ``store``: a directory or ``s3://`` URL (default
    ``AOTC_STORE``); ``remote``: pull-through and push target (default ``AOTC_REMOTE``);
    ``trust``: public keys an entry must be signed by (besides ``AOTC_TRUST_KEYS``);
    ``splitting_ops`` (default ``AOTC_SPLITTING_OPS``, else vLLM's attention ops, aten SDPA and
    ``aotc::attention``); ``compile_sizes``: static artifacts besides the dynamic one (default
    ``AOTC_COMPILE_SIZES``, else none); ``tolerance`` of the numeric check (default by dtype);
    ``inductor``: config patches; ``name``: the store entry's name; ``mode``: a ``torch.compile``
    mode (:func:`aotc.backend.config.mode_patches`); ``fallback``: ``inductor``, ``eager`` or
    ``error`` for a graph aotc cannot serve (default ``AOTC_FALLBACK``, else ``inductor``);
    ``merge``: removed (merged programs are gone): given, it is one warning line and ignored."""
    return AotcBackend(BackendConfig.make(store, remote, trust, splitting_ops, compile_sizes,
                                          tolerance, inductor, name, mode, fallback, merge))


_DEFAULT: AotcBackend | None = None


def aotc_backend(gm: Any, example_inputs: Sequence[Any], **kwargs: Any) -> Any:
    """The ``"aotc"`` backend torch's registry finds through the entry point: every setting from
    the environment. ``torch.compile``'s ``mode=`` and ``options=`` (``aotc.backend`` arguments
    or Inductor config names) are applied per call (:func:`aotc.backend.config.call_config`)."""
    global _DEFAULT
    if _DEFAULT is None:
        _DEFAULT = AotcBackend(BackendConfig())
    return _DEFAULT(gm, example_inputs, **kwargs)


_STORES: set[str] = set()  # the local stores the backends made in this process name (aotc.backend(store=…))


def _speculation_machine(settings: Any) -> str | None:
    """The toolchain fingerprint the kernels' header is kept by, or None when a local store this
    process's backends use (``settings``' default, the ones ``aotc.backend(store=…)`` named) has
    served this machine's toolchain before (its toolchain memo is there): the next compile is then
    most likely a hit — a warm start runs no compiler, not even ahead of time."""
    from aotc.lookup.toolchain import fingerprint

    machine = fingerprint("cpu")
    roots = {settings.default_store_path(), *(Path(s).expanduser() for s in _STORES)}
    served = any((root / "store-v1" / "toolchain" / f"{machine}.json").is_file() for root in roots)
    return None if served else machine


def start_kernel_header() -> None:
    """The kernels' header and the ISA probes started ahead, for a store that has not served
    this toolchain: Dynamo's start callback (torch calls it), and the import of the module
    torch's registry loads for ``backend="aotc"`` (:mod:`aotc.backend.entry`), whichever comes
    first; decided once per process."""
    from aotc._torch import kernel_header
    from aotc.backend.config import DEFAULT_INDUCTOR
    from aotc.settings import Settings

    # decided at the first compile of the process: a cold store, that compile most likely misses
    kernel_header.speculate(dict(DEFAULT_INDUCTOR), lambda: _speculation_machine(Settings.from_env()))


def _end_kernel_header() -> None:
    from aotc._torch import kernel_header

    kernel_header.cancel()


@contextlib.contextmanager
def kernel_header_window() -> Iterator[None]:
    """Around a compile Dynamo's callbacks do not announce (the precompile door's AOT capture):
    the kernels' header and the ISA probes started before it, what still runs killed after it
    (:mod:`aotc._torch.kernel_header`)."""
    start_kernel_header()
    try:
        yield
    finally:
        _end_kernel_header()


# Importing this module means the process compiles with aotc's backend (torch's registry, aotc.backend(),
# the precompile door): Dynamo's next compile starts the kernels' precompiled header on the core its
# trace leaves idle, and its end kills what still runs (aotc._torch.kernel_header).
def _arm() -> None:
    from aotc._torch import dynamo

    dynamo.around_compiles(start_kernel_header, _end_kernel_header)


_arm()
