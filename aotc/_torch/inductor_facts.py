"""Machine facts from torch's private compile APIs: the toolchain key factors, Inductor's settings
as they enter the key (its whole portable config minus a deny-list), the config aotc always
compiles and loads with, and torch's own compile counters. Beside :mod:`aotc._torch.inductor_compile`
and :mod:`aotc._torch.inductor_load`; these are the only modules that touch ``torch._inductor`` /
``torch._dynamo`` internals.

Tested on torch 2.13 (CPU): ``config_values`` keys 580 Inductor settings + 20 of
``config_comms``, 42 denied (31 by torch's ``_cache_config_ignore_prefix``, 11 by
:data:`CONFIG_DENY`). Written for 2.11–2.13 (CUDA and 2.11 not yet run): attributes that may be
missing are feature-checked (``save_config_portable``'s ``ignore_private_configs``,
``config_comms``, each of :data:`_KEYED_APART`).
"""

from __future__ import annotations

import contextlib
import enum
import importlib
import inspect
import json
import math
import os
import platform
import subprocess
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch

from aotc._torch.scoped_env import process_scope
from aotc.counters import COUNTERS as _ours

# Config aotc compiles, keys and loads with. Precompiled headers ON: a C++ kernel builds in about
# half the time (the ~150 MB header is built once per machine and compiler flags, under
# Inductor's default cache dir, not in the scoped one). The setting defines a macro on the
# kernel's command line, so it enters the kernel's name (its cache key) and a load through
# Inductor must use it too; such a load would then preprocess (or build) the header before it
# looks for the kernel, which ``inductor_load`` stops: the kernels are shipped, nothing builds.
# ``cpp.vec_isa_ok``: trust the CPU's flags for the vector ISA instead of compiling a test
# program per ISA (seconds per process) — the ISA is in the key already (``toolchain.vec_isa``);
# the ISA-extension probes (AVX512-BF16, VNNI, AMX) still run.
# ``unsafe_marked_cacheable_functions``: higher-order ops whose bodies are subgraph modules of
# the graph (``cond``'s branches, a loop's body) may be saved by ``standalone_compile``: torch
# leaves them out of its caches only because it does not vouch for every such op, yet its cache
# key pickles a graph module with its submodules, so the bodies are keyed (aotc's graph key
# spells them out as well).
_SUBGRAPH_OPS = ("cond", "while_loop", "while_loop_stack_output", "map_impl", "scan",
                 "associative_scan", "wrap", "wrap_with_set_grad_enabled", "wrap_with_autocast",
                 "hints_wrapper")
_FIXED_CONFIG: dict[str, Any] = {
    "cpp_cache_precompile_headers": True, "cpp.vec_isa_ok": True,
    "unsafe_marked_cacheable_functions": {f"torch.ops.higher_order.{op}": "aotc-subgraph-op"
                                          for op in _SUBGRAPH_OPS},
}


def cacheable_functions() -> dict[str, str]:
    """The ``unsafe_marked_cacheable_functions`` aotc compiles with (:data:`_SUBGRAPH_OPS`)."""
    return dict(_FIXED_CONFIG["unsafe_marked_cacheable_functions"])


def _known(config: Any, name: str) -> bool:
    obj = config
    for part in name.split("."):
        if not hasattr(obj, part):
            return False
        obj = getattr(obj, part)
    return True


@contextlib.contextmanager
def _config_patch(options: dict[str, Any]) -> Iterator[None]:
    """``torch._inductor.config.patch`` of aotc's fixed config, then ``options`` (the
    manifest's patches win), for the block; the config is the process's, so the block holds
    :func:`~aotc._torch.scoped_env.process_scope` (another thread's patch waits)."""
    from torch._inductor import config

    fixed = {k: v for k, v in _FIXED_CONFIG.items() if _known(config, k)}
    with process_scope(), config.patch({**fixed, **options}):
        yield


def _first_line(cmd: Sequence[str]) -> str | None:
    try:
        res = subprocess.run(list(cmd), capture_output=True, text=True, timeout=30, check=False)
    except (OSError, subprocess.SubprocessError):
        return None
    lines = (res.stdout or res.stderr).strip().splitlines()
    return lines[0].strip() if lines else None


def _native_march(cxx: str) -> str | None:
    """The CPU the compiler resolves ``-march=native`` to (``cooperlake``, ``znver4`` …): Inductor
    builds CPU kernels with it, so kernels are only safe on CPUs of that kind."""
    try:
        res = subprocess.run([cxx, "-march=native", "-Q", "--help=target"], capture_output=True,
                             text=True, timeout=30, check=False)
    except (OSError, subprocess.SubprocessError):
        return None
    for line in res.stdout.splitlines():
        parts = line.split()
        if len(parts) == 2 and parts[0] == "-march=":
            return parts[1]
    return None


# Inductor's settings enter the key as its whole portable config, as its own FX graph cache hashes
# it (``FxGraphHashDetails``): ``save_config_portable(ignore_private_configs=False)`` — every
# setting but aliases and the prefixes of torch's ``_cache_config_ignore_prefix`` (trace/debug
# output, ``compile_threads``, ``worker_start_method``, cutlass install dirs, cache switches …) —
# plus what ``FxGraphHashDetails`` hashes beside it by hand (the custom passes, by their
# ``uuid()``, and the provenance level), plus ``config_comms`` where torch has it; minus aotc's
# deny-list :data:`CONFIG_DENY`. A new Inductor setting is keyed the day torch adds it.
_KEYED_APART = ("pre_grad_custom_pass", "post_grad_custom_pre_pass", "post_grad_custom_post_pass",
                "joint_custom_pre_pass", "joint_custom_post_pass", "_pre_fusion_custom_pass",
                "_fuse_ddp_communication_passes", "trace.provenance_tracking_level")
_COMMS_MODULE = "torch._inductor.config_comms"  # where torch has it; keyed as "config_comms.NAME"

# Settings torch's portable config keeps that cannot change a kernel and would split the key by
# machine or run: where files go, how workers log. Matched as a name or a dotted prefix.
CONFIG_DENY: dict[str, str] = {
    "global_cache_dir": "a cache location",
    "rocm.ck_dir": "an install location (absolute path)",
    "aot_inductor.output_path": "where AOTInductor writes its package",
    "triton.proton_output_dir": "a profiler's output location",
    "profile_bandwidth_output": "a profiler's output file",
    "autoheuristic_log_path": "a log location",
    "worker_log_path": "a log location",
    "torchinductor_worker_logpath": "a log location",
    "worker_suppress_logging": "compile workers' logging",
    "log_tlparse": "logging",
    "verbose_progress": "a progress bar",
}


def _compiler_names(cxx: Any) -> Any:
    """``cpp.cxx`` without install locations: ``(None, "/usr/bin/g++")`` -> ``[None, "g++"]``. The
    compiler itself is keyed by its version line (the toolchain's ``cxx``)."""
    if not isinstance(cxx, (list, tuple)):
        return cxx
    return [os.path.basename(c) if isinstance(c, str) else c for c in cxx]


# Settings whose value is spelled for the key before it is made canonical.
_SPELLINGS: dict[str, Callable[[Any], Any]] = {"cpp.cxx": _compiler_names}


def _denied(name: str) -> bool:
    return any(name == d or name.startswith(d + ".") for d in CONFIG_DENY)


def _read(module: Any, name: str) -> Any:
    obj = module
    for part in name.split("."):
        obj = getattr(obj, part)
    return obj


def _save_portable(module: Any) -> dict[str, Any]:
    """``module.save_config_portable`` with the private settings, as ``FxGraphHashDetails``
    calls it (feature-checked: an older torch without the argument leaves them out)."""
    save = module.save_config_portable
    if "ignore_private_configs" in inspect.signature(save).parameters:
        return dict(save(ignore_private_configs=False))
    return dict(save())


def _comms_settings() -> dict[str, Any]:
    """``torch._inductor.config_comms``'s portable settings as ``config_comms.NAME`` ({} on a
    torch without that module)."""
    try:
        comms = importlib.import_module(_COMMS_MODULE)
    except ImportError:
        return {}
    if not hasattr(comms, "save_config_portable"):
        return {}
    return {f"config_comms.{k}": v for k, v in _save_portable(comms).items()}


def _portable_settings() -> dict[str, Any]:
    """Every setting Inductor's FX graph cache keys, raw, as this process has them now."""
    from torch._inductor import config

    values = _save_portable(config)
    values.update({name: _read(config, name) for name in _KEYED_APART if _known(config, name)})
    values.update(_comms_settings())
    return values


def _uuid_spelling(obj: Any, name: str) -> Any:
    """An object's ``uuid()`` (a ``CustomGraphPass``'s): Inductor's own spelling of it in its
    cache key. ``None`` means the object vouches for nothing: a ``TypeError``."""
    uid = obj.uuid()
    if uid is None:
        raise TypeError(f"Inductor setting {name}: {type(obj).__name__}.uuid() returned None, so "
                        "it has no stable spelling for the key")
    return {"uuid": uid.hex() if isinstance(uid, bytes) else _canonical(uid, f"{name}.uuid()")}


def _canonical(value: Any, name: str) -> Any:
    """``value`` as JSON-able data that is the same in every process: lists for tuples, sorted
    lists for sets, ``Module.Class.NAME`` for an enum, ``{"uuid": …}`` for an object with a
    ``uuid()``. Anything else — a plain function, a class, an object, NaN, an absolute path — is a
    ``TypeError``: a setting left out of the key is a wrong artifact handed back later."""
    if isinstance(value, enum.Enum):
        return f"{type(value).__module__}.{type(value).__qualname__}.{value.name}"
    if isinstance(value, float) and not math.isfinite(value):
        raise TypeError(f"Inductor setting {name}: non-finite float {value!r} has no canonical form")
    if isinstance(value, str) and os.path.isabs(value):
        raise TypeError(f"Inductor setting {name}: an absolute path ({value!r}) would differ per "
                        "machine; if it cannot change a kernel add it to CONFIG_DENY")
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, (list, tuple)):
        return [_canonical(v, f"{name}[{i}]") for i, v in enumerate(value)]
    if isinstance(value, (set, frozenset)):
        return sorted((_canonical(v, name) for v in value), key=lambda v: json.dumps(v, sort_keys=True))
    if isinstance(value, dict):
        return {_dict_key(k, name): _canonical(v, f"{name}.{k}") for k, v in value.items()}
    if not isinstance(value, type) and callable(getattr(value, "uuid", None)):
        return _uuid_spelling(value, name)
    raise TypeError(f"Inductor setting {name}: {type(value).__name__} ({value!r:.60}) has no stable "
                    "spelling for the key; give it a uuid() (a CustomGraphPass) or unset it")


def _dict_key(key: Any, name: str) -> str:
    if not isinstance(key, str):
        raise TypeError(f"Inductor setting {name}: mapping key {key!r} is not a string")
    return key


def config_values() -> dict[str, Any]:
    """Inductor's settings as this process would compile with them before the manifest's
    patches — defaults, TORCHINDUCTOR_* variables, in-process changes and aotc's fixed config
    applied — by name (``"cpp.dynamic_threads"``), canonical and JSON-able: the whole portable
    config (see :data:`_KEYED_APART`) minus :data:`CONFIG_DENY`. Raises ``TypeError`` on a kept
    setting whose value has no stable spelling (:func:`_canonical`)."""
    with _config_patch({}):
        settings = _portable_settings()
    return {name: _canonical(_SPELLINGS.get(name, _same)(value), name)
            for name, value in sorted(settings.items()) if not _denied(name)}


def _same(value: Any) -> Any:
    return value


_TOOLCHAIN_MEMO: dict[str, dict[str, Any]] = {}


def toolchain_factors(device: str) -> dict[str, Any]:
    """Memoized per process and device (it runs the C++ compiler twice); see ``_toolchain``."""
    if device not in _TOOLCHAIN_MEMO:
        _TOOLCHAIN_MEMO[device] = _toolchain(device)
    return dict(_TOOLCHAIN_MEMO[device])


def _vec_isa() -> str | None:
    """The vector ISAs this CPU offers Inductor, without Inductor's compiler probe (3.6 s on a
    2-core Xeon: ``VecAMX`` builds a test program even with ``cpp.vec_isa_ok``). On x86 the flags
    Inductor's own checker reads (AMX only with the kernel's permission); elsewhere Inductor's
    pick with the probe off. What the compiler can build is in the ``cxx`` and ``march`` factors."""
    from torch._inductor import config, cpu_vec_isa

    checker = getattr(cpu_vec_isa, "x86_isa_checker", None)
    if platform.machine() in ("x86_64", "AMD64") and checker is not None:
        flags = list(checker())
        if "amx_tile" in flags and not torch.cpu._init_amx():
            flags.remove("amx_tile")
        return " ".join(flags) or None
    with config.patch({"cpp.vec_isa_ok": True}):
        return str(cpu_vec_isa.pick_vec_isa()) or None


def _toolchain(device: str) -> dict[str, Any]:
    """What the compiled artifacts depend on besides the model: a JSON-able dict.

    torch version and ``torch_key``, triton version, python, the C/C++ compiler's id line, and
    for CPU the vector ISA Inductor picks (from CPU flags, without running the compiler probe)
    or for CUDA the GPU name, compute capability and CUDA version. No paths, hosts or times.
    """
    from torch._inductor.codecache import torch_key

    try:
        triton_version: str | None = importlib.import_module("triton").__version__
    except Exception:  # noqa: BLE001 - absent or broken triton
        triton_version = None
    try:
        from torch._inductor.cpp_builder import get_cpp_compiler

        cxx = get_cpp_compiler()
    except Exception:  # noqa: BLE001 - code we do not own fails in many ways; each is turned into one of ours
        cxx = os.environ.get("CXX", "g++")
    factors: dict[str, Any] = {
        "torch": torch.__version__,
        "torch_key": torch_key().hex(),
        "triton": triton_version,
        "python": f"{platform.python_implementation()} {platform.python_version()}",
        "cxx": _first_line([cxx, "--version"]),
        "machine": platform.machine(),
    }
    dev = torch.device(device)
    if dev.type == "cpu":
        from torch._inductor import config

        factors["vec_isa"] = _vec_isa()
        factors["aten_cpu_capability"] = torch.backends.cpu.get_cpu_capability()
        factors["march"] = config.cpp.march if getattr(config.cpp, "march", None) else _native_march(cxx)
    elif dev.type == "cuda":
        idx = dev.index if dev.index is not None else torch.cuda.current_device()
        cap = torch.cuda.get_device_capability(idx)
        factors.update(gpu=torch.cuda.get_device_name(idx), compute_capability=f"{cap[0]}.{cap[1]}",
                       cuda=torch.version.cuda)
    else:
        factors["device_type"] = dev.type
    return factors


def counters_snapshot() -> dict[str, int]:
    """Counts since process start, from torch's own counters.

    ``frames_traced``/``graphs_captured`` (Dynamo), ``fx_graph_cache_hits``/``_misses``/
    ``_bypasses`` (Inductor; a miss or bypass is a real Inductor compile), ``autograd_cache_*``,
    plus aotc's own ``compiles`` (``compile_piece`` calls), ``loads`` (artifacts loaded) and
    ``fast_loads`` (of those, loaded through ``aotc._torch.wrapper`` without importing Inductor).
    """
    import sys
    from collections import Counter, defaultdict

    counters: Any = defaultdict(Counter)  # Dynamo/Inductor never imported: nothing ran
    if "torch._dynamo.utils" in sys.modules:
        from torch._dynamo.utils import counters
    ind, aot = counters["inductor"], counters["aot_autograd"]
    st, fr = counters["stats"], counters["frames"]
    return {
        "frames_traced": int(fr.get("total", 0)),
        "graphs_captured": int(st.get("unique_graphs", 0)),
        "fx_graph_cache_hits": int(ind.get("fxgraph_cache_hit", 0)),
        "fx_graph_cache_misses": int(ind.get("fxgraph_cache_miss", 0)),
        "fx_graph_cache_bypasses": int(ind.get("fxgraph_cache_bypass", 0)),
        "inductor_compiles": int(
            ind.get("fxgraph_cache_miss", 0) + ind.get("fxgraph_cache_bypass", 0)
        ),
        "autograd_cache_hits": int(aot.get("autograd_cache_hit", 0)),
        "autograd_cache_misses": int(aot.get("autograd_cache_miss", 0)),
        "traces": _ours.traces,
        "cache_hits": _ours.cache_hits,
        "compiles": _ours.compiles,
        "loads": _ours.loads,
        "fast_loads": _ours.fast_loads,
    }


def mode_options(mode: str) -> dict[str, Any] | None:
    """The Inductor config patches ``torch.compile(mode=mode)`` stands for
    (``torch._inductor.list_mode_options``), or None when torch knows no such mode."""
    from torch._inductor import list_mode_options

    try:
        return dict(list_mode_options(mode))
    except (KeyError, RuntimeError, ValueError):
        return None


def compile_modes() -> list[str]:
    """The ``mode=`` values ``torch.compile`` accepts (``default`` included)."""
    from torch._inductor import list_mode_options

    return sorted({"default", *list_mode_options()})


def is_inductor_option(name: str) -> bool:
    """Whether ``name`` (``"cpp.dynamic_threads"``) is one of Inductor's config settings."""
    from torch._inductor import config

    return _known(config, name)


def inductor_compile(gm: Any, example_inputs: Any, patches: dict[str, Any]) -> Any:
    """Inductor's own ``torch.compile`` backend on a graph Dynamo handed aotc (the fallback for
    a graph aotc cannot serve), with ``patches`` applied around it."""
    from torch._inductor import config
    from torch._inductor.compile_fx import compile_fx

    known = {k: v for k, v in patches.items() if _known(config, k)}
    with config.patch(known):
        return compile_fx(gm, example_inputs)
