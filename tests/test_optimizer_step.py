"""Graphs that read tensors by attribute and write weights in place, served (issue 46): a compiled
``Adam.step()`` — Dynamo hands the optimizer's parameters and state to the graph as ``get_attr``
nodes — compiled cold by aotc in this process and loaded warm in a fresh one, each with the same
weights after three steps as eager's; and a model whose layer the user marked as a nested compile
region, split at attention like any other. Real compiles: slow."""

from __future__ import annotations

import json
import subprocess
import textwrap
from pathlib import Path

import pytest
import torch

from tests.conftest import PYTHON, python_env

pytestmark = pytest.mark.slow

ADAM = textwrap.dedent("""
    import json, sys, torch, aotc

    def train(backend):
        torch.manual_seed(0)
        m = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
        opt = torch.optim.Adam(m.parameters(), lr=1e-2)
        step = torch.compile(lambda: opt.step(), backend=backend)
        x = torch.randn(8, 16, generator=torch.Generator().manual_seed(1))
        for _ in range(3):
            opt.zero_grad()
            m(x).sum().backward()
            step()
        return [p.detach().clone() for p in m.parameters()]

    be = aotc.backend(store=sys.argv[1], fallback="error")
    got, want = train(be), train("eager")
    print(json.dumps({"err": max((a - b).abs().max().item() for a, b in zip(got, want)),
                      "hit": be.last.get("hit"), "fallback": be.last.get("fallback")}))
""")


def _adam(store: Path) -> dict:
    done = subprocess.run([PYTHON, "-c", ADAM, str(store)], capture_output=True, text=True,
                          env=python_env(), timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_adam_step_served_cold_then_warm(tmp_path: Path) -> None:
    cold = _adam(tmp_path / "store")
    assert cold["hit"] is False and cold["fallback"] is None, cold
    assert cold["err"] < 1e-6, cold  # the check ran on copies: the weights took 3 steps, not 9
    warm = _adam(tmp_path / "store")
    assert warm["hit"] is True and warm["fallback"] is None, warm
    assert warm["err"] < 1e-6, warm


def test_a_user_marked_region_is_split_at_attention(tmp_path: Path) -> None:
    import aotc
    from aotc.models import toy_llama as tl

    model = tl.build(layers=3, hidden=64, heads=4, vocab=128)
    ids, pos = torch.randint(0, 128, (12,)), torch.arange(12)
    torch._dynamo.mark_dynamic(ids, 0)
    torch._dynamo.mark_dynamic(pos, 0)
    own = tl.Layer.forward
    tl.Layer.forward = torch.compiler.nested_compile_region(own)
    try:
        torch._dynamo.reset()
        be = aotc.backend(store=str(tmp_path / "store"), fallback="error")
        with torch.no_grad():
            got = torch.compile(model, backend=be)(ids, pos)
    finally:
        tl.Layer.forward = own
        torch._dynamo.reset()
    with torch.no_grad():
        want = model(ids, pos)
    assert (be.last["pieces"], be.last["unique_pieces"]) == (7, 3), be.last
    assert (got - want).abs().max().item() < 1e-5
