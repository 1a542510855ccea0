"""The runtime by composition, in the shape of vLLM's ``CUDAGraphWrapper``: a wrapper (CUDA graph
capture/replay, the compile-time check's zeroing of an attention op's output) is put around a
piece's callable when the piece table is built, never swapped in and out on a shared object;
and a wrapper around a runner names what it offers instead of forwarding every attribute.

The layout half walks the source (``ast``); the behaviour half runs a hand-made stitched program
(two compiled pieces of plain Python callables around one eager splitting piece) on CPU, CUDA
graphs included through the stand-in of ``tests.helpers.emulated_graph``.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch

from aotc.errors import LoadError
from aotc.records.graphcode import encode_graph
from aotc.records.program import PieceRecord, Program, Slot
from aotc.runtime.cudagraph import GraphedRunner, capture
from aotc.runtime.graphcall import GraphRunner
from aotc.runtime.runner import Runner
from aotc.runtime.stitched import PieceCall, SplittingCall
from tests.helpers.emulated_graph import EmulatedGraph

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("aotc", "cache", "cli")  # aotc, aotc.cache, aotc.cli


def _modules() -> Iterator[tuple[str, ast.Module]]:
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            yield str(path.relative_to(ROOT)), ast.parse(path.read_text(), str(path))


def _hook_targets(node: ast.AST) -> Iterator[ast.Attribute | ast.Call]:
    """Assignments (plain, annotated, augmented; ``setattr``/``object.__setattr__`` with a
    constant name) to an attribute named ``*_hook`` under ``node``."""
    for n in ast.walk(node):
        targets: list[ast.AST] = []
        if isinstance(n, ast.Assign):
            targets = [t for tgt in n.targets for t in ast.walk(tgt)]
        elif isinstance(n, (ast.AnnAssign, ast.AugAssign)):
            targets = [n.target]
        elif isinstance(n, ast.Call) and len(n.args) >= 2 and isinstance(n.args[1], ast.Constant) \
                and str(n.args[1].value).endswith("_hook") and (
                    (isinstance(n.func, ast.Name) and n.func.id == "setattr")
                    or (isinstance(n.func, ast.Attribute) and n.func.attr == "__setattr__")):
            yield n
        for t in targets:
            if isinstance(t, ast.Attribute) and t.attr.endswith("_hook"):
                yield t


def _own_init_assignment(t: ast.Attribute | ast.Call, inits: set[int]) -> bool:
    """``self.x_hook = …`` directly inside an ``__init__`` (the object's own construction)."""
    return isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name) and t.value.id == "self" \
        and id(t) in inits


def test_no_module_assigns_to_another_objects_hook() -> None:
    """A hook is set when its object is built (``self.…_hook`` in ``__init__``) or not at all:
    no compile-time check or CUDA graph capture swaps one in and out on a shared runner."""
    bad = []
    for rel, tree in _modules():
        inits: set[int] = set()
        for fn in ast.walk(tree):
            if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)) and fn.name == "__init__":
                inits |= {id(t) for t in _hook_targets(fn)}
        for t in _hook_targets(tree):
            if not _own_init_assignment(t, inits):
                bad.append(f"{rel}:{t.lineno}: {ast.unparse(t)}")
    assert not bad, "assigned to another object's hook:\n" + "\n".join(bad)


def _forwards(fn: ast.FunctionDef) -> bool:
    """Whether ``__getattr__``/``__setattr__`` hands the name on to an attribute of ``self``
    (``getattr(self.runner, name)``, ``setattr(self.runner, …)``)."""
    for n in ast.walk(fn):
        if isinstance(n, ast.Call) and isinstance(n.func, ast.Name) and n.func.id in ("getattr", "setattr") \
                and n.args and isinstance(n.args[0], ast.Attribute) \
                and isinstance(n.args[0].value, ast.Name) and n.args[0].value.id == "self":
            return True
        if isinstance(n, ast.Attribute) and isinstance(n.value, ast.Attribute) \
                and isinstance(n.value.value, ast.Name) and n.value.value.id == "self" \
                and n.attr in ("__getattr__", "__getattribute__", "__setattr__"):
            return True
    return False


def test_no_class_forwards_attributes_to_a_wrapped_runner() -> None:
    """A wrapper (``GraphedRunner``) names what its callers use; it does not forward every
    attribute to the runner inside it."""
    bad = []
    for rel, tree in _modules():
        for cls in ast.walk(tree):
            if not isinstance(cls, ast.ClassDef):
                continue
            for fn in cls.body:
                if isinstance(fn, ast.FunctionDef) and fn.name in ("__getattr__", "__setattr__",
                                                                   "__getattribute__") and _forwards(fn):
                    bad.append(f"{rel}:{fn.lineno}: {cls.name}.{fn.name}")
    assert not bad, "forwards attributes to a wrapped object:\n" + "\n".join(bad)


# ------------------------------------------------------------------ a hand-made stitched program


class _Stitch(torch.nn.Module):
    """compiled ``submod_0`` → splitting ``submod_1`` → compiled ``submod_2``."""

    def __init__(self) -> None:
        super().__init__()
        self.submod_0, self.submod_1, self.submod_2 = (torch.nn.Identity() for _ in range(3))

    def forward(self, w: torch.Tensor, x: torch.Tensor, n: int) -> Any:
        return self.submod_2(self.submod_1(self.submod_0(x, w)))


class _Attention(torch.nn.Module):
    def forward(self, a: torch.Tensor) -> torch.Tensor:
        return a * 3


class _Model(torch.nn.Module):
    """What the program computes, run eagerly."""

    def __init__(self) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.tensor([1.0, 2.0, 3.0]))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (x * self.w + 1) * 3 - 2


class _Leaves(torch.fx.Tracer):
    def is_leaf_module(self, m: torch.nn.Module, qualname: str) -> bool:
        return qualname.startswith("submod_")


def _program() -> Program:
    stitch = torch.fx.GraphModule(_Stitch(), _Leaves().trace(_Stitch()))
    attention = torch.fx.symbolic_trace(_Attention())
    return Program(
        name="hand-made", device="cpu", dtype="float32",
        slots=(Slot("param", fqn="w", shape=[3], dtype="float32"), Slot("input", index=0, dim=0),
               Slot("symbol", index=0, dim=0)),
        inputs=({"name": "x", "dtype": "float32", "shape": ["tokens", 3]},),
        stitch=encode_graph(stitch),
        pieces=(PieceRecord("submod_0", "compiled", uid="u0", returns_tuple=False),
                PieceRecord("submod_1", "splitting", graph=encode_graph(attention), op="attention"),
                PieceRecord("submod_2", "compiled", uid="u2", returns_tuple=False)),
        artifacts=(), kernel_roles={}, compile_sizes=(4,), capture_sizes=(), max_tokens=16,
        dynamic_mode="backed", min_dynamic_tokens=1, source_files={})


def _artifacts(calls: list[str]) -> dict[str, dict[int | None, Any]]:
    def at(name: str, fn: Any) -> Any:
        def artifact(*args: Any) -> list[torch.Tensor]:
            calls.append(name)
            return [fn(*args)]
        return artifact

    return {"u0": {None: at("u0 dynamic", lambda x, w: x * w + 1), 4: at("u0 at 4", lambda x, w: x * w + 1)},
            "u2": {None: at("u2 dynamic", lambda y: y - 2)}}


def test_wrappers_are_put_around_the_pieces_once_when_the_table_is_built() -> None:
    calls: list[str] = []
    wrapped: list[str] = []

    def wrap(kind: str) -> Any:
        def wrapper(name: str, call: Any) -> Any:
            wrapped.append(f"{kind} {name}")

            def run(*args: Any) -> Any:
                calls.append(f"{kind} {name}")
                return call(*args)
            return run
        return wrapper

    program, model = _program(), _Model()
    artifacts = _artifacts(calls)
    plain = Runner(program, artifacts, model)
    assert [type(c) for c in plain._modules.values()] == [PieceCall, SplittingCall, PieceCall]
    runner = Runner(program, artifacts, model, wrap_piece=wrap("piece"), wrap_splitting=wrap("attn"))
    assert wrapped == ["piece submod_0", "attn submod_1", "piece submod_2"]
    x = torch.randn(4, 3)
    torch.testing.assert_close(runner(x), model(x))
    assert calls == ["piece submod_0", "u0 at 4", "attn submod_1", "piece submod_2", "u2 dynamic"]
    calls.clear()
    torch.testing.assert_close(plain(x[:3]), model(x[:3]))  # the plain runner: no wrapper at all
    assert calls == ["u0 dynamic", "u2 dynamic"] and len(wrapped) == 3
    again = plain.wrapped(wrap_splitting=wrap("other"))  # a new runner over the same artifacts
    assert again is not plain and again.artifacts is plain.artifacts and again.model is plain.model
    assert [type(c) for c in plain._modules.values()] == [PieceCall, SplittingCall, PieceCall]
    graph_slots = (Slot("input", index=0), Slot("input", index=1, dim=0), Slot("symbol", index=2))
    graph = GraphRunner(replace(program, slots=graph_slots), artifacts, wrap_piece=wrap("graph"))
    w = model.w.detach()
    torch.testing.assert_close(graph(w, x, 4), model(x))
    assert wrapped[-2:] == ["graph submod_0", "graph submod_2"]


@pytest.mark.parametrize("mode", ["piecewise", "full"])
def test_graphs_compose_around_a_runner_of_their_own(mode: str) -> None:
    """CUDA graphs on the CPU stand-in: the captured runner is a new one over the same
    artifacts (each compiled piece wrapped), the given runner keeps its plain piece table, and
    every call matches the model at, between and above the capture sizes."""
    calls: list[str] = []
    program, model = _program(), _Model()
    plain = Runner(program, _artifacts(calls), model)
    table = dict(plain._modules)
    graphed = capture(plain, mode, [4, 2], graph_cls=EmulatedGraph, device="cpu")
    assert isinstance(graphed, GraphedRunner) and graphed.graphs.report.sizes == [4, 2]
    assert plain._modules == table
    if mode == "piecewise":
        assert graphed.runner is not plain and graphed.graphs.report.graphs == 4
        assert [type(c).__name__ for c in graphed.runner._modules.values()] == \
            ["_GraphedPiece", "SplittingCall", "_GraphedPiece"]
    else:
        assert graphed.runner is plain and graphed.graphs.report.graphs == 2
    for n in (1, 2, 3, 4, 5, 9):
        x = torch.randn(n, 3)
        torch.testing.assert_close(graphed(x), model(x))
        torch.testing.assert_close(graphed.eager(x), model(x))
    calls.clear()
    graphed(torch.randn(3, 3))  # replayed at 4: the stand-in re-runs the static artifact
    assert "u0 at 4" in calls and "u0 dynamic" not in calls
    assert graphed.program is program and graphed.input_names == ("x",)
    assert graphed.warmup([2]) >= 0 and "capture" in graphed.timings.phases
    with pytest.raises(LoadError, match="already captured"):
        capture(graphed, mode, [2], graph_cls=EmulatedGraph, device="cpu")  # type: ignore[arg-type]


def test_the_plain_stitch_names_a_failed_piece_and_passes_other_errors_through() -> None:
    """The straight-line stitch of a plain runner: each size's artifacts called directly (the
    static one at its size), a kernel's RuntimeError named by piece and size, and an error that is
    not a kernel's (out of memory, a RuntimeError subclass) reaching the caller as it is."""
    from aotc.errors import RunError

    calls: list[str] = []
    program, model = _program(), _Model()
    artifacts = _artifacts(calls)
    plain = Runner(program, artifacts, model)
    x = torch.randn(4, 3)
    torch.testing.assert_close(plain(x), model(x))
    assert calls == ["u0 at 4", "u2 dynamic"]
    for raised, caught in ((RuntimeError("index out of bounds: 0 <= tmp2 < 300L"), RunError),
                           (torch.OutOfMemoryError("out of memory"), torch.OutOfMemoryError)):
        def failing(y: torch.Tensor, error: BaseException = raised) -> list[torch.Tensor]:
            raise error

        broken = Runner(program, {**artifacts, "u2": {None: failing}}, model)
        with pytest.raises(caught) as got:
            broken(x)
        if caught is RunError:
            assert "piece submod_2" in str(got.value) and "index out of bounds" in str(got.value)
