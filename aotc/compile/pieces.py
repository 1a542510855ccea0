"""Model → one Dynamo capture → pieces, each compiled piece named by a unique id derived from
Inductor's own cache key (identical pieces share it). Shared by the compiler and its workers, which
must agree on the ids."""

from __future__ import annotations

import hashlib
import time
from dataclasses import dataclass
from typing import Any

from aotc._torch import inductor_compile
from aotc.compile.capture import Captured
from aotc.compile.repeated import capture_repeated
from aotc.compile.split import Piece, SplitResult, node_op_names, split
from aotc.errors import SplitError
from aotc.gc_pause import gc_paused
from aotc.manifest import Manifest
from aotc.model.build import build_model, by_name, dynamic_dims, make_inputs
from aotc.progress import Progress


@dataclass(frozen=True)
class Traced:
    """The model, its capture, the split, and the unique-piece table."""

    model: Any
    captured: Captured
    parts: SplitResult
    uid_of: dict[str, str]  # piece name -> unique id (compiled pieces only)
    first_of: dict[str, Piece]  # unique id -> first piece with it, in order
    warnings: list[str]
    regions: str = ""  # what the capture did with the repeated layers (RegionReport.line)
    stamped: int = 0  # how many layers it stamped out (aotc.compile.stamp)


def _check_splitting_ops(manifest: Manifest, gm: Any, pieces: int) -> None:
    if manifest.splitting_ops and pieces == 1:
        seen = sorted({n for node in gm.graph.nodes for n in node_op_names(node) if "::" in n})
        where = f"{manifest.path or '<manifest>'}: splitting_ops"
        raise SplitError(
            f"{where}: none of {list(manifest.splitting_ops)} is called by the traced model "
            f"(ops seen: {', '.join(seen[:10])}{'…' if len(seen) > 10 else ''}); fix the op names"
        )


def piece_uid(piece: Piece, options: dict[str, Any]) -> str:
    """16 hex chars of the sha256 of Inductor's dynamic-shape cache key of ``piece`` (the first
    one ``x`` when the key is aotc's structural fallback: ``aotc.compile.reuse`` skips those)."""
    full = inductor_compile.piece_cache_key(piece.gm, list(piece.example_inputs), True, options=options)
    uid = hashlib.sha256(full.encode()).hexdigest()[:16]
    # "x…": keyed by aotc's structural fallback, not Inductor's key: never shared across entries
    return "x" + uid[1:] if full.startswith("aotc-") else uid


def unique_pieces(pieces: Any, options: dict[str, Any]) -> tuple[dict[str, str], dict[str, Piece]]:
    """``(uid of each compiled piece by name, first piece of each uid in order)``. Inductor's
    key (an AOTAutograd trace of the piece) is computed once per structure: a transformer's
    middle layers are one structure, so 8 layers cost 3 traces, not 9."""
    uid_of: dict[str, str] = {}
    first_of: dict[str, Piece] = {}
    by_structure: dict[str, str] = {}
    for p in pieces:
        if p.is_splitting:
            continue
        shape = inductor_compile.structural_key(p.gm, list(p.example_inputs))
        uid = by_structure.get(shape)
        if uid is None:
            uid = by_structure[shape] = piece_uid(p, options)
        uid_of[p.name] = uid
        first_of.setdefault(uid, p)
    return uid_of, first_of


def build_for_trace(manifest: Manifest, progress: Progress | None = None,
                    seconds: dict[str, float] | None = None) -> Any:
    """The manifest's model, called by name as the manifest calls it (what a trace takes)."""
    progress = progress or Progress(quiet=True)
    what = manifest.model.factory or (manifest.model.hf.architecture if manifest.model.hf else "?")
    progress.phase("build", what)
    t = time.perf_counter()
    model = by_name(build_model(manifest), manifest)
    if seconds is not None:
        seconds["build"] = time.perf_counter() - t
    return model


def trace_and_split(manifest: Manifest, progress: Progress | None = None,
                    seconds: dict[str, float] | None = None, regions: str | None = None,
                    model: Any = None) -> Traced:
    """Build (unless ``model``: :func:`build_for_trace`'s), capture once (token dim dynamic),
    split at the splitting ops, dedup the pieces. ``regions``: the manifest's ``regions`` unless
    given (``"off"``: every layer traced)."""
    progress = progress or Progress(quiet=True)
    seconds = seconds if seconds is not None else {}
    if model is None:
        model = build_for_trace(manifest, progress, seconds)

    progress.phase("capture", "Dynamo, token dim dynamic")
    t = time.perf_counter()
    trace_n = min(manifest.max_tokens, 7)
    captured, report = capture_repeated(model, make_inputs(manifest, trace_n), dynamic_dims(manifest),
                                        params_of=model.model,
                                        wanted=manifest.regions if regions is None else regions)
    seconds["capture"] = time.perf_counter() - t

    t = time.perf_counter()
    with gc_paused():  # (aotc.gc_pause) split_module and the pieces' keys make many objects
        parts = split(captured.gm, list(manifest.splitting_ops))
        _check_splitting_ops(manifest, captured.gm, len(parts.pieces))
        uid_of, first_of = unique_pieces(parts.pieces, dict(manifest.inductor))
    seconds["split"] = time.perf_counter() - t
    progress.phase("split", f"{len(parts.pieces)} pieces, {len(first_of)} unique to compile "
                            f"(regions: {report.line()})")
    for w in parts.warnings:
        progress.note(w)
    return Traced(model, captured, parts, uid_of, first_of, list(parts.warnings), report.line(), report.stamped)


def _dense_order(shape: list[int], strides: list[int]) -> list[int] | None:
    """The dims of a dense, non-overlapping layout from outermost to innermost, or None."""
    order = sorted(range(len(shape)), key=lambda d: (strides[d], shape[d]), reverse=True)
    expected = 1
    for d in reversed(order):
        if shape[d] != 1 and strides[d] != expected:
            return None
        expected *= max(shape[d], 1)
    return order


def _writes_in_place(gm: Any) -> bool:
    """Whether a piece writes anything in place (:func:`aotc._torch.ops.written_values`: an op
    whose schema says so, an in-place method or function (``mul_``), an item assignment)."""
    from aotc._torch.ops import written_values

    return any(written_values(n) for n in gm.graph.nodes)


def _symbolic(val: Any) -> bool:
    import torch

    return any(isinstance(s, torch.SymInt) for s in (*val.shape, *val.stride()))


def input_layouts(parts: SplitResult, piece: Piece) -> list[list[int] | None] | None:
    """For each input of compiled ``piece`` that another piece produces, or that is a graph
    input of dynamic shape, the dense layout Inductor compiled it for (from the traced strides):
    the runtime hands the piece a copy in that layout when the caller's differs (an Inductor
    piece or an eager attention op may lay out an output otherwise than the trace did — Phi-3's
    rotary output, then SDPA's; a caller may pass a view — Dynamo guards no strides of a
    dynamic input)."""
    import torch

    from aotc._torch.dynamo import symint_hint

    calls = {str(n.target): n for n in parts.stitch.graph.nodes if n.op == "call_module"}
    fed = calls[piece.name].args
    out: list[list[int] | None] = []
    placeholders = [n for n in piece.gm.graph.nodes if n.op == "placeholder"]
    writes = _writes_in_place(piece.gm)
    for i, node in enumerate(placeholders):
        val = node.meta.get("example_value", node.meta.get("val"))
        source = fed[i] if i < len(fed) else None
        if not isinstance(val, torch.Tensor) or not isinstance(source, torch.fx.Node) or val.dim() < 2 \
                or source.op == "placeholder" and (not _symbolic(val) or writes):
            # a graph input of fixed shape (a weight): Dynamo guards its layout; a piece that
            # writes in place (through a view, maybe): a copy would leave the caller's unwritten
            out.append(None)
            continue
        shape = [symint_hint(s) for s in val.shape]
        strides = [symint_hint(s) for s in val.stride()]
        if any(v is None for v in shape + strides):
            out.append(None)
            continue
        out.append(_dense_order(shape, strides))  # type: ignore[arg-type]  # checked above: no None left
    return out if any(o is not None for o in out) else None


def piece_records(parts: SplitResult, uid_of: dict[str, str]) -> tuple[Any, ...]:
    """The program's piece table: each compiled piece by its unique id (with its input
    layouts), each splitting piece with its graph, in stitching order."""
    from aotc._torch.ops import graph_returns_tuple
    from aotc.compile.split import splitting_op_of
    from aotc.records.graphcode import encode_graph
    from aotc.records.program import PieceRecord

    return tuple(
        PieceRecord(p.name, "compiled", uid=uid_of[p.name], returns_tuple=graph_returns_tuple(p.gm),
                    layouts=input_layouts(parts, p)) if not p.is_splitting else
        PieceRecord(p.name, "splitting", graph=encode_graph(p.gm), op=splitting_op_of(p.gm))
        for p in parts.pieces)
