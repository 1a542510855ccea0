"""transformers' ``generate()`` with its decode step precompiled: no Dynamo trace at a warm start.

With a compileable cache (``cache_implementation="static"``) ``generate()`` runs the prefill
eagerly and every decode step through ``model.get_compiled_call(compile_config)`` — by default a
``torch.compile(model.__call__)`` that Dynamo traces in every new process. :func:`serve_generate`
answers that call with :func:`aotc.precompiled` of the model under its own entry name
(``<model class>:generate``): a warm process loads Dynamo's stored decode step and runs it after
a guard check; a cold one traces and stores it at its first decode step (the live step is the
example input), so the next process starts warm. A decode step of another shape class (another
batch size or cache length) takes the traced path.

transformers compiles only on accelerators unless the compile config says
``_compile_all_devices``; ``serve_generate`` sets it on the model's generation config (a
``CompileConfig`` is made when the model has none).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

__all__ = ["serve_generate"]


def serve_generate(model: Any, *, name: str | None = None, **options: Any) -> Any:
    """Make ``model.generate()`` run its decode step precompiled (module doc); returns the
    :class:`~aotc.dynamo_artifacts.load.Precompiled` step (``served``/``traced`` count its calls).
    ``name``: the entry's name (default ``<model class>:generate``); ``options``:
    :func:`aotc.precompiled`'s (``store``, ``remote``, ``trust``, backend options)."""
    from transformers import CompileConfig

    from aotc.dynamo_artifacts.key import target_id
    from aotc.dynamo_artifacts.load import precompiled

    identity, _ = target_id(model)
    step = precompiled(model, name=name or f"{identity}:generate", **options)
    config = model.generation_config
    if getattr(config, "compile_config", None) is None:
        config.compile_config = CompileConfig()
    config.compile_config._compile_all_devices = True  # transformers compiles only on accelerators otherwise

    model.get_compiled_call = _DecodeStep(step, model)  # the instance's own: generate() asks it per call
    return step


class _DecodeStep:
    """``model.get_compiled_call``: the precompiled step, whatever compile config is asked for.
    Dynamo pickles the model's attributes with its guards: this pickles as nothing (the step
    holds locks and loaded programs). A copy of the model (``copy.deepcopy``) gets
    transformers' own compiled call: the step is bound to the original's weights."""

    def __init__(self, step: Any, model: Any) -> None:
        import weakref

        self.step = step
        self._model: Callable[[], Any] = weakref.ref(model)

    def __call__(self, compile_config: Any = None) -> Any:
        model = self._model()
        if self.step is not None or model is None:
            return self.step
        return type(model).get_compiled_call(model, compile_config)  # transformers' own

    def __deepcopy__(self, memo: dict[int, Any]) -> _DecodeStep:
        original = self._model()
        copied = memo.get(id(original)) if original is not None else None
        clone = _DecodeStep.__new__(_DecodeStep)
        clone.__setstate__({})
        if copied is not None:
            import weakref

            clone._model = weakref.ref(copied)
        return clone

    def __getstate__(self) -> dict[str, Any]:
        return {}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.step, self._model = None, (lambda: None)
