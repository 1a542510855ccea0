"""A repeated layer traced once (issue 46): which classes become nested compile regions, one body
per kind of layer, every reuse proven (the weights each call gets, the structure of each layer
sharing a body), a wrong reuse refused, and the graph flat and equal to eager's afterwards.
Real Dynamo traces (no compile): quick."""

from __future__ import annotations

import types
from typing import Any

import pytest
import torch

from aotc._torch import regions
from aotc.compile import repeated
from aotc.compile.capture import capture, graph_args
from aotc.errors import CaptureError
from aotc.models import toy_llama as tl

reuses = pytest.mark.skipif(not regions.supported(), reason="this torch does not reuse a traced region")


def _toy(layers: int = 4) -> tuple[torch.nn.Module, list[torch.Tensor]]:
    model = tl.build(layers=layers, hidden=64, heads=4, vocab=128)
    return model, [torch.randint(0, 128, (9,)), torch.arange(9)]


def _out(x):
    return x[0] if isinstance(x, (tuple, list)) else x


def _same_as_eager(captured, model, inputs, params_of=None) -> float:
    with torch.no_grad():
        got = _out(captured.gm(*graph_args(captured.arg_spec, params_of or model, inputs)))
        want = _out(model(*inputs))
    return (got - want).abs().max().item()


@reuses
def test_layers_traced_as_one_body_then_flat_and_right():
    model, inputs = _toy(4)
    before = tl.Layer.__dict__["forward"]
    captured, report = repeated.capture_repeated(model, inputs, [0, 0])
    assert (report.calls, report.bodies, report.fallback) == (4, 1, ""), report
    assert report.classes == ("Layer",)
    assert not regions.region_calls(captured.gm)  # inlined: the split sees attention
    assert sum("attention" in str(n.target) for n in captured.gm.graph.nodes) == 4
    assert _same_as_eager(captured, model, inputs) == 0.0
    assert tl.Layer.__dict__["forward"] is before  # the class is as it was


@reuses
def test_regions_off_and_by_name():
    model, inputs = _toy(3)
    _, off = repeated.capture_repeated(model, inputs, [0, 0], wanted="off")
    assert (off.classes, off.calls) == ((), 0)
    _, named = repeated.capture_repeated(model, inputs, [0, 0], wanted=["Layer"])
    assert (named.calls, named.bodies) == (3, 1)
    with pytest.raises(CaptureError, match="no module of class 'DecoderLayer'"):
        repeated.capture_repeated(model, inputs, [0, 0], wanted=["DecoderLayer"])


def test_a_torch_that_does_not_reuse_traces_plainly(monkeypatch):
    model, inputs = _toy(3)
    monkeypatch.setattr(regions, "supported", lambda: False)
    captured, report = repeated.capture_repeated(model, inputs, [0, 0])
    assert report.calls == 0 and "does not reuse" in report.fallback
    assert not regions.region_calls(captured.gm)


def test_auto_picks_the_outermost_repeated_user_class():
    class Expert(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w = torch.nn.Linear(4, 4)

        def forward(self, x):
            return self.w(x)

    class Block(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.experts = torch.nn.ModuleList(Expert() for _ in range(2))
            self.lins = torch.nn.ModuleList(torch.nn.Linear(4, 4) for _ in range(2))

        def forward(self, x):
            return sum(e(x) for e in self.experts)

    class Net(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.blocks = torch.nn.ModuleList(Block() for _ in range(3))

        def forward(self, x):
            for b in self.blocks:
                x = b(x)
            return x

    assert repeated.repeated_classes(Net()) == [Block]  # not Expert (inside), not torch's Linear


@reuses
def test_a_layer_that_differs_is_a_kind_of_its_own():
    """A submodule hook, another attribute value, an instance's own forward: traced apart."""
    model, inputs = _toy(5)
    model.layers[1].gate_proj.register_forward_hook(lambda m, a, out: out * 2)
    model.layers[2].input_norm.eps = 1e-3
    own = tl.Layer.forward  # (as accelerate's hooks keep the forward they wrap)
    model.layers[3].forward = types.MethodType(lambda self, x, cos, sin: own(self, x, cos, sin) + 1,
                                               model.layers[3])
    kinds = repeated._kinds(model, [tl.Layer])[0]
    assert sorted(len(k) for k in kinds) == [1, 1, 1, 2]
    captured, report = repeated.capture_repeated(model, inputs, [0, 0])
    # layers 0 and 4 share a body; 1 and 2 are regions called once (Dynamo inlines those); 3 inline
    assert (report.calls, report.bodies, report.fallback) == (2, 1, ""), report
    assert _same_as_eager(captured, model, inputs) == 0.0


class _Processor:
    """As diffusers' attention processors: one object per layer, the same class and attributes."""

    def __init__(self, scale: float = 1.0) -> None:
        self.scale = scale


def test_equal_dicts_methods_and_small_objects_do_not_split_kinds():
    """A client corpus found identical layers keyed apart, so never stamped out: peft's
    per-layer ``r``/``scaling`` dicts and ``kwargs`` naming the layer, torchao's per-instance
    ``extra_repr`` bound to the layer, diffusers' per-layer processor objects. Equal values now
    key alike (a name differing by the layer's index is left out, as the index is); other values
    do not."""
    model, _ = _toy(4)

    def extra_repr(self):
        return "quantized"

    for i, layer in enumerate(model.layers):
        layer.r, layer.processor = {"default": 8}, _Processor()
        layer.gate_proj.extra_repr = types.MethodType(extra_repr, layer.gate_proj)
        # peft's per-layer kwargs name the layer: left out as its index is
        layer.gate_proj.kwargs = {"target_name": f"model.layers.{i}.gate_proj", "loaded_in_8bit": False}
    kinds, _, left_out = repeated._kinds(model, [tl.Layer])
    assert len(kinds) == 1 and left_out[0] == {"kwargs"}
    model.layers[1].r = {"default": 16}  # another rank
    model.layers[2].processor = _Processor(0.5)  # another processor setting
    model.layers[3].gate_proj.extra_repr = types.MethodType(extra_repr, model.layers[0].gate_proj)  # bound elsewhere
    assert sorted(len(k) for k in repeated._kinds(model, [tl.Layer])[0]) == [1, 1, 1, 1]


def test_layer_index_attribute_does_not_split_kinds():
    model, inputs = _toy(3)
    for i, layer in enumerate(model.layers):
        layer.layer_idx = i + 10  # as transformers' layers carry their index
    assert repeated._index_attributes(list(model.layers)) == {"layer_idx"}
    assert len(repeated._kinds(model, [tl.Layer])[0]) == 1


@reuses
def test_a_wrong_reuse_is_refused():
    """torch 2.13 stamps out a region bound to one instance (``layer.forward = region(...)``)
    with the FIRST layer's weights at every later call: the proof catches it."""
    model, inputs = _toy(3)
    for layer in model.layers:
        layer.forward = torch.compiler.nested_compile_region(tl.Layer.forward).__get__(layer)
    try:
        captured = capture(model, inputs, [0, 0])
    finally:
        for layer in model.layers:
            del layer.forward
    calls = regions.region_calls(captured.gm)
    if len({c.body for c in calls}) == len(calls):
        pytest.skip("this torch traced each bound region on its own (no reuse to refuse)")
    with pytest.raises(CaptureError, match="already used|no single layer"):
        repeated._prove(captured, model, [tl.Layer])


def _hf(kind: str, layers: int = 6) -> torch.nn.Module:
    import transformers as T

    torch.manual_seed(0)
    common = dict(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=layers,
                  num_attention_heads=4, num_key_value_heads=2, use_cache=False)
    if kind == "gemma2":  # sliding-window and global attention, alternating
        return T.Gemma2ForCausalLM(T.Gemma2Config(**common, head_dim=8, sliding_window=4)).eval()
    if kind == "moe":  # a mixture of experts every other layer
        return T.Qwen2MoeForCausalLM(T.Qwen2MoeConfig(
            **common, decoder_sparse_step=2, num_experts=4, num_experts_per_tok=2,
            moe_intermediate_size=16, shared_expert_intermediate_size=16)).eval()
    return T.Qwen2ForCausalLM(T.Qwen2Config(**common)).eval()


class _Logits(torch.nn.Module):
    """A transformers model called by its ids, one field of its output returned."""

    def __init__(self, model: torch.nn.Module, field: str = "logits") -> None:
        super().__init__()
        self.model, self.field = model, field

    def forward(self, ids):
        return getattr(self.model(input_ids=ids), self.field)


@reuses
def test_a_model_that_builds_a_kv_cache_is_traced_plainly():
    """transformers' ``use_cache``: the cache update in every layer makes no layer reusable; and
    calling it with ``use_cache=False`` would be another model (the position ids are then read
    as packed sequences: another mask), so aotc traces it as it is."""
    model = _hf("qwen2")
    model.config.use_cache = True
    wrapped = _Logits(model)
    ids = torch.randint(0, 128, (1, 10))
    captured, report = repeated.capture_repeated(wrapped, [ids], [1], params_of=wrapped)
    assert report.calls == 0 and "KV cache" in report.fallback, report
    assert not regions.region_calls(captured.gm)
    assert _same_as_eager(captured, wrapped, [ids]) == 0.0


@reuses
def test_a_gpt_neox_builds_a_kv_cache_though_its_docstring_sets_is_decoder():
    """GPT-NeoX (Pythia): decoder-only, ``is_decoder`` off in its config, and its forward's
    docstring example sets ``config.is_decoder``: its cache is built, its layers are not reused."""
    import transformers as T

    torch.manual_seed(0)
    config = T.GPTNeoXConfig(vocab_size=128, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                             intermediate_size=64)
    assert config.use_cache is True and config.is_decoder is False
    wrapped = _Logits(T.GPTNeoXForCausalLM(config).eval())
    captured, report = repeated.capture_repeated(wrapped, [torch.randint(0, 128, (1, 10))], [1], params_of=wrapped)
    assert report.calls == 0 and "KV cache" in report.fallback, report


@reuses
@pytest.mark.parametrize("decoder", [False, True])
def test_a_bert_encoder_reuses_its_layers_though_its_config_says_use_cache(decoder):
    """BERT's config has ``use_cache`` on by default; its model reads it only as a decoder
    (``config.is_decoder``): an encoder (sentence-transformers' models) builds no cache, and its
    layers are stamped out like any other model's; the same model as a decoder is traced plainly."""
    import transformers as T

    torch.manual_seed(0)
    config = T.BertConfig(vocab_size=128, hidden_size=32, num_hidden_layers=6, num_attention_heads=4,
                          intermediate_size=64, is_decoder=decoder)
    assert config.use_cache is True
    wrapped = _Logits(T.BertModel(config).eval(), "last_hidden_state")
    ids = torch.randint(0, 128, (1, 10))
    captured, report = repeated.capture_repeated(wrapped, [ids], [1], params_of=wrapped)
    if decoder:
        assert report.calls == 0 and "KV cache" in report.fallback, report
    else:
        assert (report.calls, report.bodies, report.stamped, report.fallback) == (6, 1, 4, ""), report
    assert _same_as_eager(captured, wrapped, [ids]) == 0.0


@reuses
@pytest.mark.parametrize("kind,bodies", [("qwen2", 1), ("gemma2", 2), ("moe", 2)])
def test_transformers_layers_one_body_per_kind(kind, bodies):
    wrapped = _Logits(_hf(kind))
    ids = torch.randint(0, 128, (1, 10))
    captured, report = repeated.capture_repeated(wrapped, [ids], [1], params_of=wrapped)
    assert (report.calls, report.bodies, report.fallback) == (6, bodies, ""), report
    assert report.stamped == 6 - 2 * bodies  # two layers of each kind traced, the rest stamped out
    assert _same_as_eager(captured, wrapped, [ids]) == 0.0


@reuses
def test_later_layers_are_stamped_out_unseen_by_dynamo():
    """Two layers of a kind are traced (the body and Dynamo's reuse of it); the rest are one
    ``layer_call`` node each at trace time, replaced by the body given their own weights, fed by
    name like every other weight: the graph is the plain trace's, op for op (the numbers equal
    eager's exactly)."""
    model, inputs = _toy(6)
    captured, report = repeated.capture_repeated(model, inputs, [0, 0])
    assert (report.calls, report.bodies, report.stamped, report.fallback) == (6, 1, 4, ""), report
    assert "4 of them stamped out" in report.line()
    plain = capture(model, inputs, [0, 0])

    def ops(gm):  # (a region's body reads a size by indexing ``size()``: its getitems left out)
        return sorted(str(n.target) for n in gm.graph.nodes
                      if n.op == "call_function" and "getitem" not in str(n.target))

    assert ops(captured.gm) == ops(plain.gm)
    assert {s.fqn for s in captured.arg_spec} == {s.fqn for s in plain.arg_spec}
    assert _same_as_eager(captured, model, inputs) == 0.0
    assert not any("layer_calls" in path for path, _ in captured.source_files)
    assert any(path.endswith("toy_llama.py") for path, _ in captured.source_files)
    assert not any("_aotc_layer" in vars(m) for m in model.modules())  # the roles undone


class _Scale(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.randn(4))

    def forward(self, x):
        return x * self.w


class _Net(torch.nn.Module):
    """Four alike layers; ``odd`` calls the last with an input of another shape."""

    def __init__(self, odd: bool) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList(_Scale() for _ in range(4))
        self.odd = odd

    def forward(self, x):
        for i, layer in enumerate(self.layers):
            x = layer(x.unsqueeze(0) if self.odd and i == 3 else x)
        return x


@reuses
def test_a_layer_called_otherwise_is_not_stamped_out():
    inputs = [torch.randn(5, 4)]
    _, same = repeated.capture_repeated(_Net(False), inputs, [0])
    assert (same.calls, same.stamped) == (4, 2), same
    assert not hasattr(_Scale.forward, "__marked_compile_region_config__")  # torch marked a copy
    model = _Net(True)
    captured, report = repeated.capture_repeated(model, inputs, [0])
    assert "called with other arguments" in report.fallback, report
    assert _same_as_eager(captured, model, inputs) == 0.0


@reuses
def test_a_layer_with_side_effects_is_not_stamped_out():
    """A forward that keeps a tensor on its module, which the model reads after the loop: Dynamo
    does not reuse such a body (a side effect), so aotc stamps nothing out (a stamped layer would
    not have stored it) and the graph is the plain trace's."""

    class Storing(_Scale):
        def forward(self, x):
            self.last = x * self.w
            return self.last

    class Reading(_Net):
        def forward(self, x):
            return super().forward(x) + self.layers[3].last

    model = Reading(False)
    model.layers = torch.nn.ModuleList(Storing() for _ in range(4))
    inputs = [torch.randn(5, 4)]
    captured, report = repeated.capture_repeated(model, inputs, [0])
    assert report.stamped == 0 and report.fallback, report
    assert _same_as_eager(captured, model, inputs) == 0.0


class _LogitsAt(torch.nn.Module):
    """Called as a manifest calls it: token ids and position ids."""

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, ids, pos):
        return self.model(input_ids=ids, position_ids=pos).logits


@reuses
def test_transformers_layers_stamped_out_given_position_ids():
    """The first layer's input (the embedding) carries another size symbol than the later
    layers' (the same size): the two traced layers differ there, and the called ones take the
    second's, as Dynamo's own reuse did."""
    wrapped = _LogitsAt(_hf("qwen2"))
    inputs = [torch.randint(0, 128, (1, 10)), torch.arange(10)[None]]
    captured, report = repeated.capture_repeated(wrapped, inputs, [1, 1], params_of=wrapped)
    assert (report.calls, report.bodies, report.stamped, report.fallback) == (6, 1, 4, ""), report
    assert _same_as_eager(captured, wrapped, inputs) == 0.0


@reuses
def test_layers_called_out_of_order_are_traced_plainly():
    """The last layer called first: its kind's body is not traced yet, nothing to stamp out from;
    the trace falls back to a plain one (one line says why) and the graph is right."""

    class Backwards(_Net):
        def forward(self, x):
            for layer in reversed(self.layers):
                x = layer(x)
            return x

    model = Backwards(False)
    inputs = [torch.randn(5, 4)]
    captured, report = repeated.capture_repeated(model, inputs, [0])
    assert report.stamped == 0 and "before its kind's first layer" in report.fallback, report
    assert _same_as_eager(captured, model, inputs) == 0.0


class _Twice(_Scale):
    def forward(self, h, x):
        return h * self.w + 2 * x


class _GivenTwice(torch.nn.Module):
    """Layer 0 gets the same tensor as both its arguments (``h = x``), the later ones two."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList(_Twice() for _ in range(5))

    def forward(self, x):
        h = x
        for layer in self.layers:
            h = layer(h, x)
        return h


class _Indexed(_Scale):
    def __init__(self, i: int) -> None:
        super().__init__()
        self.layer_idx = i

    def forward(self, x):
        return x * self.w * (2.0 if self.layer_idx >= 3 else 1.0)


class _Scaled(_Scale):
    def __init__(self) -> None:
        super().__init__()
        self.scale = 1.0

    def forward(self, x):
        return x * self.w * self.scale


class _SetsScale(_Net):
    def forward(self, x):
        for i, layer in enumerate(self.layers):
            layer.scale = 3.0 if i >= 2 else 1.0
            x = layer(x)
        return x


class _LaterAutocast(_Net):
    def forward(self, x):
        for i, layer in enumerate(self.layers):
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=i >= 2):
                x = layer(x).float()
        return x


_MODE = 1.0  # a module-level global _ChangesState sets between layers


class _Shared:
    def __init__(self) -> None:
        self.mode = 1.0


class _Moded(_Scale):
    def __init__(self, state: Any) -> None:
        super().__init__()
        self.scale, self.state = 1.0, state

    def forward(self, x):
        return x * self.w * _MODE * self.scale * self.state.mode


class _ChangesState(_Net):
    """Between layers: a global, a shared object's attribute, or each layer's attribute (reset
    after the loop: the layers' structure keys read after the trace are as before it)."""

    def __init__(self, what: str) -> None:
        super().__init__(False)
        self.what, self.state = what, _Shared()
        self.layers = torch.nn.ModuleList(_Moded(self.state) for _ in range(5))

    def forward(self, x):
        global _MODE
        for i, layer in enumerate(self.layers):
            value = 3.0 if i >= 2 else 1.0
            if self.what == "global":
                _MODE = value
            elif self.what == "shared":
                self.state.mode = value
            else:
                layer.scale = value
            x = layer(x)
        _MODE, self.state.mode = 1.0, 1.0
        for layer in self.layers:
            layer.scale = 1.0
        return x


@reuses
@pytest.mark.parametrize("case", ["same tensor twice", "index read", "attribute set", "autocast",
                                  "global", "shared", "set and reset"])
def test_what_a_stamped_layer_would_get_wrong_is_traced_plainly(case):
    """Found by reviews, each a wrong answer before it was checked: a layer given one tensor
    twice (a body then takes one for the other, Dynamo's own reuse too), a body that reads the
    layer's index, an attribute the model sets between layers, autocast around later layers; a
    global, a shared object's attribute or a layer's attribute the model changes between layers
    and puts back after them (a client corpus: served wrong where the numeric check's inputs did
    not show it)."""
    x = torch.randn(5, 4)
    if case in ("global", "shared", "set and reset"):
        model, why = _ChangesState(case), "between its layers"
    elif case == "same tensor twice":
        model, why = _GivenTwice(), "same tensor in two places"
    elif case == "index read":
        model, why = _Net(False), "body reads ['layer_idx']"
        model.layers = torch.nn.ModuleList(_Indexed(i) for i in range(5))
    elif case == "attribute set":
        model, why = _SetsScale(False), "attributes changed while the model ran"
        model.layers = torch.nn.ModuleList(_Scaled() for _ in range(4))
    else:
        model, why = _LaterAutocast(False), "different grad or autocast modes"
    captured, report = repeated.capture_repeated(model, [x], [0])
    assert report.stamped == 0 and why in report.fallback, report
    assert _same_as_eager(captured, model, [x]) == 0.0
