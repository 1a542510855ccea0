"""What an ``aotc`` backend is configured with: the store, a remote, a trust policy, the splitting
ops, the compile sizes, the numeric check's tolerance and Inductor patches. Defaults come from
the settings (``AOTC_STORE``, ``AOTC_REMOTE``, ``AOTC_TRUST_KEYS``, ``AOTC_SPLITTING_OPS``,
``AOTC_COMPILE_SIZES``), read when the backend is called, not when it is made."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from aotc.errors import BackendError
from aotc.log import logger
from aotc.settings import Settings

_log = logger("backend")

__all__ = ["DEFAULT_INDUCTOR", "DEFAULT_SPLITTING_OPS", "FALLBACKS", "LATE_ENV", "BackendConfig", "fallback_policy",
           "mode_patches"]

# vLLM 0.32's graph calls both of its ops per layer (KV cache write, then attention into an
# output buffer); older vLLM calls unified_attention; plain models reach SDPA; aotc's toy models
# call aotc::attention.
DEFAULT_SPLITTING_OPS = (
    "vllm::unified_kv_cache_update",
    "vllm::unified_attention_with_output",
    "vllm::unified_attention",
    "aten::scaled_dot_product_attention",
    "aotc::attention",
)


# Inductor settings read from the environment at each backend call (BackendConfig.with_env),
# parsed as Inductor parses them ("1": on), besides Inductor's own read at its import
LATE_ENV = {"TORCHINDUCTOR_CPP_DYNAMIC_THREADS": "cpp.dynamic_threads"}

# Inductor patches the backend compiles with unless given others: Inductor's own defaults but for
# the precompiled C++ header, which is off. CPU kernels are written for the process's thread
# count, which is in the key (aotc.lookup.resolve.inductor_factors); kernels that read it at run
# time (``cpp.dynamic_threads``, which vLLM's CPU platform sets for its workers) cost a decode
# step of transformers' generate() 3 % here (bench/hf_generate.py's decode, paired in one process).
# The header (aotc's fixed config turns it on: aotc._torch.inductor_facts): ``aotc compile``
# builds it while Dynamo traces, but the backend is called after the trace, so on a machine
# without the header its ~150 MB build stood between the trace and the first kernel: off, a cold
# backend compile of the 0.5B bench model took 11.4 s instead of 15.7 s, of the toy Llama 6.5-7.0
# instead of 9.8-10.4 s; on a machine that has the header it costs the toy ~0.7 s (5.6 vs 5.0 s)
# and the 0.5B model nothing measurable (one batched translation unit per compile parses the
# headers once). A fixed choice, not one made by whether the header exists here: it is in the key.
# The batch of a backend compile's kernels gets aotc's own header instead, built while Dynamo
# traces and used only if ready in time (aotc._torch.kernel_header; docs/backend.md).
DEFAULT_INDUCTOR: dict[str, Any] = {"cpp_cache_precompile_headers": False}


def _sizes(value: Any, where: str) -> tuple[int, ...]:
    if value is None:
        return ()
    if isinstance(value, str):
        value = [v for v in value.replace(",", " ").split() if v]
    try:
        sizes = sorted({int(v) for v in value})
    except (TypeError, ValueError) as e:
        raise BackendError(f"{where}: compile sizes must be positive integers, got {value!r}") from e
    if any(s < 1 for s in sizes):
        raise BackendError(f"{where}: compile sizes must be positive integers, got {value!r}")
    return tuple(sizes)


def _ops(value: Any, where: str) -> tuple[str, ...]:
    if isinstance(value, str):
        value = [v for v in value.replace(",", " ").split() if v]
    ops = tuple(str(v).strip() for v in value if str(v).strip())
    bad = [o for o in ops if "::" not in o and "." not in o]
    if bad:
        raise BackendError(f"{where}: {bad[0]!r} is not an op name; write 'namespace::op' "
                           "(e.g. 'vllm::unified_attention_with_output') or a Python qualname")
    return ops


FALLBACKS = ("inductor", "eager", "error")


def fallback_policy(value: str | None, where: str = "AOTC_FALLBACK") -> str:
    """What a graph the backend cannot serve falls back to: ``inductor`` (default), ``eager`` or
    ``error`` (raise: for CI and tests)."""
    policy = (value or "inductor").strip().lower()
    if policy not in FALLBACKS:
        raise BackendError(f"{where}={value!r}: expected one of {', '.join(FALLBACKS)}")
    return policy


def mode_patches(mode: str | None, where: str = "torch.compile(mode=…)") -> tuple[dict[str, Any], bool]:
    """``(Inductor patches, CUDA graphs wanted)`` of a ``torch.compile`` mode: ``default`` and
    ``lite`` as Inductor has them, ``max-autotune*`` Inductor's autotuning patches (in the key);
    ``reduce-overhead`` (and ``max-autotune``) ask for CUDA graphs, which aotc does its own way
    — piecewise, around the attention pieces — and never through Inductor."""
    from aotc._torch.inductor_facts import compile_modes, mode_options

    if mode is None:
        return {}, False
    patches = mode_options(str(mode))
    if patches is None:
        raise BackendError(f"{where}: unknown mode {mode!r}; torch.compile's modes are "
                           f"{', '.join(compile_modes())}")
    graphs = bool(patches.pop("triton.cudagraphs", False))
    return patches, graphs


@dataclass(frozen=True)
class BackendConfig:
    """One backend's settings; ``None`` fields take the settings' values at call time."""

    store: Any = None
    remote: Any = None
    trust: tuple[str, ...] = ()
    splitting_ops: tuple[str, ...] | None = None
    compile_sizes: tuple[int, ...] | None = None
    atol: float = 1e-4
    rtol: float = 1e-4
    tolerance_set: bool = False
    inductor: dict[str, Any] = field(default_factory=lambda: dict(DEFAULT_INDUCTOR))
    name: str = "torch.compile"
    mode: str | None = None
    graphs: bool = False  # CUDA graphs asked for (mode="reduce-overhead"/"max-autotune")
    fallback: str | None = None  # None: AOTC_FALLBACK, else "inductor"

    @classmethod
    def make(cls, store: Any = None, remote: Any = None, trust: Iterable[str] | str = (),
             splitting_ops: Iterable[str] | str | None = None,
             compile_sizes: Iterable[int] | str | None = None, tolerance: Any = None,
             inductor: dict[str, Any] | None = None, name: str | None = None,
             mode: str | None = None, fallback: str | None = None,
             merge: Any = None) -> BackendConfig:
        """Validate ``aotc.backend(...)``'s arguments (a bad one is a ``BackendError`` naming it).
        ``tolerance``: a float (atol = rtol), ``(atol, rtol)`` or ``{"atol": …, "rtol": …}``;
        default by dtype (float32 1e-4, float16 1e-2, bfloat16 3e-2). ``merge``: removed (the
        merged programs are gone); given, it is one warning line and ignored."""
        if merge is not None:
            _log.warning("aotc: warning: merged programs were removed in this version; merge= is ignored")
        atol = rtol = 1e-4
        if tolerance is not None:
            try:
                if isinstance(tolerance, dict):
                    atol = float(tolerance["atol"])
                    rtol = float(tolerance["rtol"] if "rtol" in tolerance else atol)
                elif isinstance(tolerance, (tuple, list)):
                    atol, rtol = float(tolerance[0]), float(tolerance[1])
                else:
                    atol = rtol = float(tolerance)
            except (KeyError, IndexError, TypeError, ValueError) as e:
                raise BackendError(f"aotc.backend(tolerance=…): expected a float, (atol, rtol) or "
                                   f"{{'atol': …, 'rtol': …}}, got {tolerance!r}") from e
            if atol < 0 or rtol < 0:
                raise BackendError(f"aotc.backend(tolerance=…) must be >= 0, got {tolerance!r}")
        if inductor is not None and not isinstance(inductor, dict):
            raise BackendError(f"aotc.backend(inductor=…) must be a dict of Inductor config "
                               f"patches, got {type(inductor).__name__}")
        trust = (trust,) if isinstance(trust, str) else tuple(trust)
        patches, graphs = mode_patches(mode, "aotc.backend(mode=…)")
        if fallback is not None:
            fallback = fallback_policy(fallback, "aotc.backend(fallback=…)")
        ops = None if splitting_ops is None else _ops(splitting_ops, "aotc.backend(splitting_ops=…)")
        sizes = None if compile_sizes is None else _sizes(compile_sizes, "aotc.backend(compile_sizes=…)")
        return cls(store=store, remote=remote, trust=trust, splitting_ops=ops, compile_sizes=sizes,
                   atol=atol, rtol=rtol, tolerance_set=tolerance is not None,
                   inductor={**patches, **(DEFAULT_INDUCTOR if inductor is None else inductor)},
                   name=name or "torch.compile", mode=mode, graphs=graphs, fallback=fallback)

    def with_env(self, environ: Mapping[str, str]) -> BackendConfig:
        """This config with the Inductor settings a server set through the environment after
        Inductor read it (:data:`LATE_ENV`) as patches, unless a patch of the setting is given:
        vLLM's CPU platform sets ``TORCHINDUCTOR_CPP_DYNAMIC_THREADS=1`` in its engine process,
        after torch is imported, for the workers it spawns — so the engine's own process (one
        process layout) and its workers compile the same kernels, kernels that read the thread
        count at run time as vLLM's thread-bound workers need, under one key."""
        late = {name: environ[var] == "1" for var, name in LATE_ENV.items()
                if var in environ and name not in self.inductor}
        return replace(self, inductor={**self.inductor, **late}) if late else self

    def on_device(self, device: str, static: bool) -> BackendConfig:
        """This config for a graph on ``device`` whose inputs all have ``static`` shapes. A mode
        that asks for CUDA graphs (``reduce-overhead``) compiles a static CPU graph as Inductor
        does in that mode, with ``triton.cudagraphs`` on: nothing is captured on CPU, and the
        generated wrapper leaves its inputs' layouts to Dynamo's guards (every size and stride
        of a static graph's inputs; aotc's runtime keeps the layouts between pieces,
        :func:`aotc.runtime.stitched.in_layouts`) instead of asserting each one per call — 2 %
        of a decode step of transformers' ``generate()`` here. A graph of dynamic shape keeps
        the asserts: Dynamo guards no stride of a dynamic input. On CUDA aotc captures its own
        graphs, piecewise, and the mode's setting stays off."""
        if not self.graphs or device != "cpu" or not static or "triton.cudagraphs" in self.inductor:
            return self
        return replace(self, inductor={**self.inductor, "triton.cudagraphs": True})

    def fallback_for(self, settings: Settings) -> str:
        """The fallback policy: given, else ``AOTC_FALLBACK``, else ``inductor``."""
        return self.fallback or fallback_policy(settings.fallback)

    def ops(self, settings: Settings) -> tuple[str, ...]:
        """The splitting ops: given, else ``AOTC_SPLITTING_OPS``, else the defaults."""
        if self.splitting_ops is not None:
            return self.splitting_ops
        if settings.splitting_ops:
            return _ops(settings.splitting_ops, "AOTC_SPLITTING_OPS")
        return DEFAULT_SPLITTING_OPS

    def sizes(self, settings: Settings) -> tuple[int, ...]:
        """The compile sizes: given, else ``AOTC_COMPILE_SIZES``, else none (dynamic only)."""
        if self.compile_sizes is not None:
            return self.compile_sizes
        return _sizes(settings.compile_sizes, "AOTC_COMPILE_SIZES")

    def tolerance_for(self, dtype: Any) -> tuple[float, float]:
        """(atol, rtol): the given tolerance, else the default of the graph's float dtype."""
        if self.tolerance_set:
            return self.atol, self.rtol
        import torch

        eps = torch.finfo(dtype).eps if dtype.is_floating_point else 0.0
        # float32 1e-4, float16 1e-2, bfloat16 3e-2; anything coarser (float8) 1e-1 at most: a
        # check that cannot fail is no check (such a graph may fall back; it is never served wrong)
        default = 1e-4 if eps <= 1.2e-7 else 1e-2 if eps <= 1e-3 else 3e-2 if eps <= 8e-3 else 1e-1
        return default, default


ARGUMENTS = ("store", "remote", "trust", "splitting_ops", "compile_sizes", "tolerance", "inductor",
             "name", "mode", "fallback")
RETIRED = ("merge",)  # accepted for old callers, ignored with one warning (BackendConfig.make)


def call_config(base: BackendConfig, kwargs: dict[str, Any]) -> BackendConfig:
    """``base`` with what ``torch.compile`` passed the backend: ``mode=`` and ``options=`` (keys
    that are ``aotc.backend`` arguments, ``triton.cudagraphs``, or Inductor config names, which
    become Inductor patches). Anything else is a one-line ``BackendError`` naming it."""
    from dataclasses import replace

    from aotc._torch.inductor_facts import is_inductor_option

    extra = sorted(set(kwargs) - {"mode", "options"})
    if extra:
        raise BackendError(f"the aotc backend got {extra[0]}=…; torch.compile passes only mode= "
                           "and options=")
    mode, options = kwargs.get("mode"), kwargs.get("options")
    if mode is None and not options:
        return base
    if options is not None and not isinstance(options, dict):
        raise BackendError(f"torch.compile(backend='aotc', options=…) must be a dict, got "
                           f"{type(options).__name__}")
    rest = dict(options or {})
    ours = {k: rest.pop(k) for k in list(rest) if k in ARGUMENTS or k in RETIRED}
    cuda_graphs = rest.pop("triton.cudagraphs", None)
    unknown = sorted(k for k in rest if not (isinstance(k, str) and is_inductor_option(k)))
    if unknown:
        raise BackendError(f"torch.compile(backend='aotc', options=…): unknown option "
                           f"{unknown[0]!r}; the options are aotc.backend's arguments "
                           f"({', '.join(ARGUMENTS)}) or Inductor config names")
    given = {"store": base.store, "remote": base.remote, "trust": base.trust,
             "splitting_ops": base.splitting_ops, "compile_sizes": base.compile_sizes,
             "tolerance": (base.atol, base.rtol) if base.tolerance_set else None,
             "inductor": base.inductor, "name": base.name, "fallback": base.fallback, **ours}
    if mode is not None:
        given["mode"] = mode
    made = BackendConfig.make(**given)
    graphs = made.graphs or base.graphs if cuda_graphs is None else bool(cuda_graphs)
    return replace(made, inductor={**made.inductor, **rest}, graphs=graphs)
