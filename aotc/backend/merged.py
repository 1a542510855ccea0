"""A split graph's merged program: the same graph compiled whole, stored beside its pieces, and
served instead of them where nothing is captured (CPU).

The split at attention is for the GPU (piecewise CUDA graphs around an attention that cannot be
captured) and for the cold compile (each unique piece compiled once). Where nothing is captured
it costs at run time: each piece allocates its own buffers (Inductor reuses buffers across a
whole graph's layers) and is called through its own wrapper — ~2 % of a small Llama's CPU decode
step (``bench/hf_generate.py``: pieces 0.99× Inductor, one piece 1.01×). So after a CPU graph
with attention is compiled in pieces and served, a child process forked at that point (it holds
the graph and its example inputs in memory: nothing is re-traced or sent;
:mod:`aotc.backend.merge_child`) compiles it once more with no splitting ops, at a lower CPU
priority, checks it against the graph run eagerly like any entry, and stores it under the key the
backend gives the graph with no splitting ops (the pieces' factors with ``backend.splitting_ops``
empty: what ``aotc.backend(splitting_ops=[])`` stores). A later start that finds it serves it
instead of the pieces; the first start is never slowed or made to wait (the pieces serve it
meanwhile). A start that loads the pieces and finds no merged program (they were stored with
merging off, or pulled from a remote that has no merged program) starts the same child. A
merge that fails is remembered (:mod:`aotc.backend.given_up`, retried with backoff);
a damaged merged entry is skipped with one line and the pieces serve. Whatever goes wrong in
starting a merge is one warning line: the graph is served by its pieces all the same.

Where not (the entry's ``mergeable``, :func:`aotc.backend.build.build_entry`; entries stored
before it have none): a graph that was not split (nothing to merge), a training graph, a graph
whose splitting op writes into a buffer the graph allocates (vLLM's attention: the check zeroes
that buffer before the op, which it cannot do inside a whole compiled graph, so such a program
could not be checked); nor a graph on another device than the CPU (CUDA graphs want the pieces;
a CUDA context does not survive a fork), a process that cannot fork, merging off (the default:
``AOTC_MERGE=1`` / ``aotc.backend(merge=True)`` turn it on — the child outlives the call that
started it, which a guest in someone else's server does only when the operator asks). A saved
record (torch's AOT path, vLLM's) loaded by key serves the merged program when merging is on.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, TypeVar

from aotc.backend.merge_child import wait_for_merges
from aotc.errors import one_line
from aotc.log import logger

__all__ = ["merge_later", "merge_wanted", "merged_entry", "merged_factors", "merged_key", "serve_merged",
           "wait_for_merges"]

_log = logger("backend")
T = TypeVar("T")


def merged_factors(factors: dict[str, Any]) -> dict[str, Any]:
    """The merged program's factors: the pieces' (``factors``) with no splitting ops — the graph
    as ``aotc.backend(splitting_ops=[])`` keys it, so either stores the same entry."""
    return {**factors, "backend": {**factors["backend"], "splitting_ops": []}}


def merged_key(factors: dict[str, Any]) -> str:
    """The store key of the merged program of the graph whose pieces have ``factors``."""
    from aotc.records.key import compute_key

    return compute_key(merged_factors(factors))


def merge_wanted(enabled: bool, example_inputs: Sequence[Any], metadata: dict[str, Any]) -> bool:
    """Whether a graph whose pieces' entry has ``metadata`` gets a merged program (module doc)."""
    if not (enabled and metadata.get("mergeable")):
        return False
    from aotc._torch.forked import fork_is_safe
    from aotc.backend.graphkey import graph_device

    return graph_device(example_inputs) == "cpu" and fork_is_safe()


def merged_entry(tiered: Any, factors: dict[str, Any], pulled: bool) -> Any:
    """The stored merged program of the graph whose pieces have ``factors``, or None: from the
    local store, or — when the pieces were just ``pulled`` from the remote — pulled too."""
    from aotc.errors import AotcError

    key = merged_key(factors)
    try:
        if tiered.has(key) or (pulled and tiered.remote is not None):
            return tiered.get(key, wait=False)
    except AotcError as e:
        if type(e).__name__ != "CacheMiss":
            _log.warning(f"aotc: warning: merged program {key[:16]}… not taken ({one_line(e, 300)}); "
                         "the pieces serve the graph")
    return None


def serve_merged(tiered: Any, factors: dict[str, Any], pulled: bool, load: Callable[[Any], T]) -> T | None:
    """``load(entry)`` of the graph's stored merged program (:func:`merged_entry`), or None when
    there is none or it cannot be loaded (a damaged entry: one warning line; the pieces serve)."""
    merged = merged_entry(tiered, factors, pulled)
    if merged is None:
        return None
    try:
        return load(merged)
    except Exception as e:  # noqa: BLE001 - the pieces serve the graph instead
        _log.warning(f"aotc: warning: merged program {merged.key[:16]}… not loaded ({one_line(e, 300)}); "
                     "the pieces serve the graph")
        return None


def merge_later(gm: Any, example_inputs: Sequence[Any], pieces_key: str, factors: dict[str, Any],
                metadata: dict[str, Any], cfg: Any, context: Any, tiered: Any,
                compile_and_store: Callable[..., dict[str, Any]]) -> int | None:
    """Compile the graph whole in a forked child and store it beside its pieces (their entry's
    ``pieces_key``, ``factors``, ``metadata``; the backend's ``cfg`` and ``context``; ``tiered``:
    the store they came from), when it is wanted and neither stored nor given up on (module
    doc). ``compile_and_store(gm, inputs, key, factors, store, cfg, context, tolerance)``
    compiles, checks and stores one graph (the backend's miss). The child's pid, or None; never
    raises (a merge that cannot start is one warning line)."""
    label = f"graph {pieces_key[:16]}…: merged program"
    try:
        if not merge_wanted(cfg.merges(context.settings), example_inputs, metadata):
            return None
        return _start(gm, example_inputs, factors, cfg, context, tiered, compile_and_store, label)
    except Exception as e:  # noqa: BLE001 - the pieces serve the graph whatever happens here
        _log.warning(f"aotc: warning: {label} not started ({one_line(e, 300)}); the pieces serve it")
        return None


def _start(gm: Any, example_inputs: Sequence[Any], factors: dict[str, Any], cfg: Any, context: Any,
           tiered: Any, compile_and_store: Callable[..., dict[str, Any]], label: str) -> int | None:
    from dataclasses import replace

    from aotc.backend import merge_child
    from aotc.backend.build import computed_float_dtype
    from aotc.backend.given_up import GivenUpBefore, failure_version, raise_if_given_up

    key = merged_key(factors)
    policy = tiered.policy.keys
    if tiered.has(key) or tiered.local.read_only or (policy and (context.signing_key is None or
                                                              context.signer.public not in policy)):
        return None  # stored; or this process could not store it, or not signed as the policy wants
    tolerance = cfg.tolerance_for(computed_float_dtype(gm, example_inputs))
    try:
        raise_if_given_up(tiered.local, key, tolerance)
    except GivenUpBefore:
        return None
    whole = replace(cfg, splitting_ops=())
    unsigned = replace(context, signing_key=None)  # the exec'd ingest signs what it takes in
    job = merge_child.MergeJob(label=f"{label} {key[:16]}…", key=key, name=cfg.name,
                               store_root=str(tiered.local.root), tmp_dir=str(tiered.local.tmp_dir),
                               remote_url=getattr(tiered.remote, "url", None),
                               version=failure_version(tolerance))

    def build(staging: Path) -> None:  # in the child: into a store of its own (merge_child doc)
        from aotc.cache import Store

        store = Store(staging)
        compile_and_store(gm, example_inputs, key, merged_factors(factors), store, whole, unsigned,
                          tolerance)
        store.close()

    return merge_child.start(job, build)
