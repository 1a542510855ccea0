"""A training piece's warm start without Inductor (aotc._torch.training_path): its forward and
backward through the wrapper fast path, joined by AOTAutograd's runtime — recorded only when it
is bit for bit Inductor's artifact (outputs, grad_fn, gradients, mutated buffers)."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import torch

from aotc._torch import inductor_compile, inductor_load, kernel_batch, training_path
from tests.conftest import PYTHON, python_env

pytestmark = pytest.mark.slow


def _train_graph() -> tuple[torch.fx.GraphModule, list[Any]]:
    """Linear → BatchNorm1d (train mode: running statistics written in place) → GELU → Linear,
    as Dynamo hands it to a backend."""
    got: dict[str, Any] = {}

    def capture(gm: torch.fx.GraphModule, example_inputs: list[Any]) -> Any:
        got["gm"], got["inputs"] = gm, list(example_inputs)
        return gm.forward

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.BatchNorm1d(8), torch.nn.GELU(),
                                torch.nn.Linear(8, 3)).train()
    torch._dynamo.reset()
    torch.compile(model, backend=capture)(torch.randn(5, 6))
    return got["gm"], got["inputs"]


@pytest.fixture(scope="module")
def piece(tmp_path_factory) -> Any:
    """The graph compiled for training, its scratch dir kept (the gate's tests re-run it)."""
    tmp = tmp_path_factory.mktemp("training")
    gm, inputs = _train_graph()
    inductor_compile.mark_training(gm)
    batch = kernel_batch.KernelBatch()
    pending = inductor_compile.start_piece(gm, inputs, None, tmp / "piece", {}, tmp, {}, "train", None, batch)
    inductor_compile.build_kernels(batch, "the training piece")
    compiled = inductor_compile.finish_piece(pending)
    yield {"pending": pending, "compiled": compiled, "tmp": tmp}
    pending.discard()


def _step(fn: Any, inputs: list[Any]) -> tuple[list[torch.Tensor], list[Any], list[torch.Tensor]]:
    values = [v.detach().clone().requires_grad_(v.requires_grad) for v in inputs]
    with torch.enable_grad():
        outs = fn(*values)
    assert outs[0].grad_fn is not None
    outs[0].sum().backward()
    return [o.detach() for o in outs], [v.grad for v in values], [v.detach() for v in values]


def test_the_record_is_written_and_runs_forward_and_backward_as_inductors(piece) -> None:
    c = piece["compiled"]
    assert c.wrapper_note == "" and c.wrapper is not None, c.wrapper_note
    data = c.wrapper.read_bytes()
    assert training_path.is_training_record(data)
    root = piece["tmp"] / "kernels"
    shutil.copytree(c.kernel_root, root)
    slow = inductor_load.load_piece(c.artifact, root)
    fast = training_path.load(data, root)
    g = torch.Generator().manual_seed(3)
    inputs = [torch.randn(v.shape, generator=g).requires_grad_(v.requires_grad) if v.is_floating_point()
              else v.clone() for v in piece["pending"].inputs]
    for want, got in zip(_step(slow, inputs), _step(fast, inputs)):
        for x, y in zip(want, got):
            assert (x is None) == (y is None)
            assert x is None or torch.equal(x, y)
    moved = [i for i, (a, b) in enumerate(zip(inputs, _step(fast, inputs)[2])) if not torch.equal(a, b)]
    assert moved, "BatchNorm's running statistics were not written"


class _DoubleGrad(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return x.clone()

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> torch.Tensor:
        return g * 2


@pytest.mark.parametrize("bad,reason", [
    (lambda outs: [o * 1.5 for o in outs], "outputs differ"),
    (lambda outs: [o.detach() for o in outs], "grad_fn"),
    (lambda outs: [_DoubleGrad.apply(o) if o.requires_grad else o for o in outs], "gradients differ"),
], ids=["outputs", "grad-fn", "gradients"])
def test_the_gate_refuses_a_runtime_that_differs_from_inductors(piece, tmp_path: Path, bad, reason) -> None:
    p = piece["pending"]
    art = p.art

    def other(*args: Any) -> list[Any]:
        return bad(list(art(*args)))

    out = tmp_path / "record.json"
    why = training_path.record_training_fast_path(other, p.inputs, p.tmp, inductor_load.kernel_files(p.tmp), out)
    assert reason in why and not out.exists(), why


def test_a_fresh_process_loads_it_without_inductors_compile_stack(piece, tmp_path: Path) -> None:
    c = piece["compiled"]
    script = (
        "import sys, json, torch\n"
        "from pathlib import Path\n"
        "from aotc._torch import training_path\n"
        f"fn = training_path.load(Path({str(c.wrapper)!r}).read_bytes(), Path({str(c.kernel_root)!r}))\n"
        f"shapes = json.loads({json.dumps([[list(v.shape), str(v.dtype), v.requires_grad] for v in piece['pending'].inputs])!r})\n"
        "args = [torch.randn(s, requires_grad=r) if 'float' in d else torch.zeros(s, dtype=torch.int64)"
        " for s, d, r in shapes]\n"
        "out = fn(*args)\n"
        "out[0].sum().backward()\n"
        "print(json.dumps({'grads': sum(a.grad is not None for a in args),"
        " 'compile_fx': 'torch._inductor.compile_fx' in sys.modules}))\n")
    res = subprocess.run([PYTHON, "-c", script], capture_output=True, text=True, env=python_env(), timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    got = json.loads(res.stdout.strip().splitlines()[-1])
    assert got == {"grads": sum(v.requires_grad for v in piece["pending"].inputs), "compile_fx": False}, got
