"""How aotc calls a model: by the manifest's input names, the declared output picked."""

from __future__ import annotations

import pytest
import torch

from aotc.errors import ManifestError
from aotc.manifest import parse_manifest
from aotc.model.build import build_model, by_name, make_named_inputs
from aotc.model.forward import pick_output


def _manifest(names: list[str]):  # type: ignore[no-untyped-def]
    return parse_manifest({
        "name": "toy", "model": {"factory": "aotc.models.toy_llama:build",
                                 "kwargs": {"layers": 1, "hidden": 32, "heads": 2, "vocab": 64}},
        "inputs": [{"name": names[0], "dtype": "int64", "shape": ["tokens"], "high": 64},
                   {"name": names[1], "dtype": "int64", "shape": ["tokens"], "fill": "arange",
                    "low": 3}]}, "m.yaml")


def test_inputs_reach_the_parameter_of_their_name() -> None:
    m = _manifest(["positions", "input_ids"])  # the forward's order is (input_ids, positions)
    model = build_model(m)
    x = make_named_inputs(m, 5)
    assert list(x) == ["positions", "input_ids"]  # the manifest's order, not the forward's
    with torch.no_grad():
        assert torch.equal(by_name(model, m)(x["positions"], x["input_ids"]), model(**x))


def test_an_input_the_forward_does_not_take_is_named() -> None:
    m = _manifest(["input_ids", "pos"])
    with pytest.raises(ManifestError, match=r"inputs\[1\].name: ToyLlama.forward has no "
                                            r"parameter 'pos' \(it takes input_ids, positions\)"):
        by_name(build_model(m), m)


def test_outputs_picked_by_key_index_or_list() -> None:
    out = {"values": torch.ones(1), "logits": torch.zeros(1)}  # a key that is also a dict method
    assert pick_output(out, "values") is out["values"]
    assert pick_output((out["logits"], out["values"]), 1) is out["values"]
    assert pick_output(out, ("logits", "values")) == (out["logits"], out["values"])
