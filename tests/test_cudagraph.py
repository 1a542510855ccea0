"""CUDA Graph capture and replay (aotc.runtime.cudagraph).

On a GPU: a toy-llama compiled for cuda, warm-started with piecewise and full graphs, matches
eager at sizes at, between and above the capture sizes. Everywhere: the bookkeeping (size choice,
padding, static buffers, slicing, full vs piecewise) runs on CPU with ``EmulatedGraph``, a
stand-in with a CUDA graph's replay semantics — replay recomputes into the SAME output tensors
from the static argument buffers' current contents — so a missed copy into a static buffer, an
output handed out without a copy, or a wrong padding shows up as a wrong result.
"""

from __future__ import annotations

import pytest
import torch
import yaml

import aotc
from aotc.model.build import make_inputs
from aotc.runtime.cudagraph import GraphSet, capture
from aotc.errors import LoadError
from aotc.manifest import load_manifest
from tests.conftest import toy_manifest

pytestmark = pytest.mark.slow


class EmulatedGraph:
    """CPU stand-in for ``torch.cuda.CUDAGraph`` (see module doc)."""

    captured = 0

    def __init__(self, pool: object) -> None:
        self.pool = pool

    @staticmethod
    def new_pool() -> object:
        return object()

    def capture(self, fn, args):  # type: ignore[no-untyped-def]
        EmulatedGraph.captured += 1
        self.fn, self.args = fn, args
        self.out = fn(*args)
        return self.out

    def replay(self) -> None:
        new = self.fn(*self.args)
        outs = self.out if isinstance(self.out, (list, tuple)) else [self.out]
        news = new if isinstance(new, (list, tuple)) else [new]
        for o, n in zip(outs, news):
            o.copy_(n)


@pytest.mark.parametrize("mode", ["piecewise", "full"])
def test_graphs_replay_matches_eager_at_every_size(compiled, mode) -> None:
    _tmp, store, results = compiled
    manifest = load_manifest(results[2][0])
    plain = aotc.load(manifest, store=store)
    assert plain.graphs is None  # CPU: no capture by default
    runner = capture(plain, mode, [8, 2, 4, 300], graph_cls=EmulatedGraph, device="cpu")
    report = runner.graphs.report  # type: ignore[union-attr]
    assert report.sizes == [8, 4, 2]  # largest first; 300 > max_tokens is dropped
    compiled_pieces = sum(p.kind == "compiled" for p in runner.program.pieces)
    assert report.graphs == (3 * compiled_pieces if mode == "piecewise" else 3)
    assert "capture" in runner.timings.phases
    outs = {}
    for n, seed in [(1, 1), (2, 2), (3, 3), (5, 4), (8, 5), (9, 6), (3, 7)]:
        x = make_inputs(manifest, n, seed=seed)
        assert runner.graphs.serves(n) == (None if n > 8 else min(c for c in (2, 4, 8) if c >= n))
        got = runner(*x)
        with torch.no_grad():
            want = runner.model(*x)
        assert got.shape == want.shape
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
        outs[(n, seed)] = (got, want)
    for got, want in outs.values():  # an earlier result was not overwritten by a later replay
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


def test_mode_none_and_bad_modes(compiled) -> None:
    _tmp, store, results = compiled
    runner = aotc.load(results[2][0], store=store)
    assert capture(runner, "none", [4]) is None and runner.piece_hook is None
    with pytest.raises(LoadError, match="expected piecewise or full"):
        GraphSet(runner, "sometimes", graph_cls=EmulatedGraph)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")
@pytest.mark.parametrize("mode", ["piecewise", "full"])
def test_cuda_graphs_on_gpu(tmp_path, mode) -> None:
    path = toy_manifest(tmp_path, 2, name=f"toy-cuda-{mode}", device="cuda", cudagraph=mode,
                        capture_sizes=[1, 2, 4, 8])
    aotc.compile(path, store=tmp_path / "store")
    runner = aotc.load(path, store=tmp_path / "store")
    report = runner.graphs.report  # type: ignore[union-attr]
    assert report.sizes == [8, 4, 2, 1] and report.graphs > 0
    print(f"{mode}: {report.to_json()}")
    manifest = load_manifest(path)
    for n in (1, 3, 8, 11, 100):
        x = make_inputs(manifest, n, seed=n)
        got = runner(*x)
        with torch.no_grad():
            want = runner.model(*x)
        torch.testing.assert_close(got, want, atol=1e-3, rtol=1e-3)
    assert yaml.safe_dump(report.to_json())
