"""CUDA Graph capture and replay (aotc.runtime.cudagraph).

On a GPU: a toy-llama compiled for cuda, warm-started with piecewise and full graphs, matches
eager at sizes at, between and above the capture sizes. Everywhere: the bookkeeping (size choice,
padding, static buffers, cutting outputs back along their token dim, full vs piecewise) runs on
CPU with ``tests.helpers.emulated_graph.EmulatedGraph``, a stand-in that captures as CUDA does
(records, runs nothing visible, refuses a host sync) and replays into the same output tensors.
"""

from __future__ import annotations

import pytest
import torch

import aotc
from aotc.errors import LoadError
from aotc.manifest import load_manifest
from aotc.model.build import make_inputs
from aotc.runtime.cudagraph import GraphSet, capture
from tests.conftest import toy_manifest
from tests.helpers.emulated_graph import EmulatedGraph, HostSyncDuringCapture

pytestmark = pytest.mark.slow


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
    table = dict(runner._modules)
    assert capture(runner, "none", [4]) is None
    with pytest.raises(LoadError, match="expected piecewise or full"):
        GraphSet(runner, "sometimes", graph_cls=EmulatedGraph)
    assert runner._modules == table  # nothing was put on the runner


def test_capture_leaves_the_loaded_runner_as_it_was(compiled) -> None:
    """Composition: the graphs are captured around a runner of their own, built from the same
    artifacts with each compiled piece wrapped; the loaded runner's piece table is untouched and
    it still runs without graphs, and a graphed runner cannot be captured again."""
    _tmp, store, results = compiled
    manifest = load_manifest(results[2][0])
    plain = aotc.load(manifest, store=store)
    table = dict(plain._modules)
    graphed = capture(plain, "piecewise", [4, 2], graph_cls=EmulatedGraph, device="cpu")
    assert graphed is not None and graphed.runner is not plain
    assert plain._modules == table and plain.graphs is None
    kinds = {p.name: p.kind for p in plain.program.pieces}
    for name, call in graphed.runner._modules.items():
        assert (type(call).__name__ == "_GraphedPiece") == (kinds[name] == "compiled")
    assert graphed.program is plain.program and graphed.model is plain.model
    assert graphed.key == plain.key and graphed.timings is plain.timings
    x = make_inputs(manifest, 3, seed=9)
    torch.testing.assert_close(graphed(*x), plain(*x), atol=1e-4, rtol=1e-4)
    with pytest.raises(LoadError, match="already captured"):
        capture(graphed, "piecewise", [4], graph_cls=EmulatedGraph, device="cpu")  # type: ignore[arg-type]
    with pytest.raises(AttributeError):
        graphed.bound_buffers  # noqa: B018 - what a caller may read is named, nothing forwarded


def test_the_stand_in_captures_as_cuda_does() -> None:
    """Capture runs nothing visible (arguments as they were, outputs garbage until the first
    replay) and refuses a host sync; replay runs the work on the arguments' current contents."""
    x = torch.tensor([1.0, 2.0])
    g = EmulatedGraph(EmulatedGraph.new_pool())

    def step(t: torch.Tensor) -> torch.Tensor:
        out = t * 2
        t.add_(1)  # a write into an argument: not done until a replay
        return out

    out = g.capture(step, [x])
    assert torch.equal(x, torch.tensor([1.0, 2.0])) and bool(out.isnan().all())
    g.replay()
    assert torch.equal(out, torch.tensor([2.0, 4.0])) and torch.equal(x, torch.tensor([2.0, 3.0]))
    x.copy_(torch.tensor([5.0, 5.0]))
    g.replay()
    assert torch.equal(out, torch.tensor([10.0, 10.0]))
    with pytest.raises(HostSyncDuringCapture, match="item during CUDA graph capture"):
        EmulatedGraph(None).capture(lambda t: t * t.sum().item(), [x])
    with pytest.raises(HostSyncDuringCapture):
        EmulatedGraph(None).capture(lambda t: t if bool(t[0] > 0) else -t, [x])


@pytest.mark.parametrize("mode", ["piecewise", "full"])
def test_batch_first_outputs_are_captured_and_cut_back_along_their_token_dim(compiled, mode) -> None:
    """An HF model's logits are ``[1, n, vocab]``: the token dim is 1. Graphs are captured at
    every size and each replay matches the model run eagerly, cut back along dim 1."""
    _tmp, store, results = compiled
    manifest = load_manifest(results["hf"][0])
    runner = capture(aotc.load(manifest, store=store), mode, [8, 4, 2, 1], graph_cls=EmulatedGraph,
                     device="cpu")
    assert runner is not None and runner.graphs.report.sizes == [8, 4, 2, 1]
    assert runner.graphs.token_dims == [1]
    for n, seed in [(1, 1), (2, 2), (3, 3), (6, 4), (8, 5), (11, 6)]:
        x = make_inputs(manifest, n, seed=seed)
        got = runner(*x)
        with torch.no_grad():
            want = runner.eager(*x)  # the model called as the manifest calls it: the logits
        assert got.shape == want.shape and got.shape[1] == n
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


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
    assert set(report.to_json()) == {"mode", "sizes", "graphs", "seconds", "pool_bytes"}


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")
def test_an_hf_model_on_gpu_captures_its_batch_first_logits(tmp_path) -> None:
    from tests.conftest import hf_manifest

    path = hf_manifest(tmp_path, name="tiny-hf-cuda", device="cuda", cudagraph="piecewise",
                       capture_sizes=[1, 2, 4, 8])
    aotc.compile(path, store=tmp_path / "store")
    runner = aotc.load(path, store=tmp_path / "store")
    assert runner.graphs is not None and runner.graphs.report.sizes == [8, 4, 2, 1]
    assert runner.graphs.token_dims == [1]
    manifest = load_manifest(path)
    for n in (1, 3, 8, 11):
        x = make_inputs(manifest, n, seed=n)
        got = runner(*x)
        with torch.no_grad():
            want = runner.eager(*x)
        assert got.shape[1] == n
        torch.testing.assert_close(got, want, atol=1e-3, rtol=1e-3)
