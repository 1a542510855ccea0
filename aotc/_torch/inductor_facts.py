"""Machine facts from torch's private compile APIs: the toolchain key factors, the values of the
code-changing Inductor settings, the config aotc always compiles and loads with, and torch's own
compile counters. Beside :mod:`aotc._torch.inductor_compile` and :mod:`aotc._torch.inductor_load`; these are
the only modules that touch ``torch._inductor`` / ``torch._dynamo`` internals.

Tested on torch 2.13 (CPU); written for 2.11–2.13 (CUDA not yet run), attributes that may be
missing are feature-checked.
"""

from __future__ import annotations

import importlib
import os
import platform
import subprocess
from collections.abc import Sequence
from typing import Any

import torch

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


def _config_patch(options: dict[str, Any]) -> Any:
    """``torch._inductor.config.patch`` of aotc's fixed config, then ``options`` (the
    manifest's patches win)."""
    from torch._inductor import config

    fixed = {k: v for k, v in _FIXED_CONFIG.items() if _known(config, k)}
    return config.patch({**fixed, **options})


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


# Inductor settings that change generated code, read after the manifest's patches (and any
# TORCHINDUCTOR_* environment variable) are applied. Cache-location and thread-count settings are
# left out: they differ per machine and do not change the kernels.
CONFIG_FACTOR_KEYS = (
    "max_autotune", "max_autotune_gemm", "max_autotune_pointwise", "coordinate_descent_tuning",
    "epilogue_fusion", "aggressive_fusion", "freezing", "fallback_random", "cpp_wrapper",
    "emulate_precision_casts", "size_asserts", "split_reductions", "benchmark_kernel",
    "cpp.simdlen", "cpp.march", "cpp.min_chunk_size", "cpp.enable_kernel_profile",
    "triton.cudagraphs", "triton.autotune_pointwise", "triton.unique_kernel_names",
)


def config_values() -> dict[str, Any]:
    """The values of the code-changing Inductor settings (``CONFIG_FACTOR_KEYS``) this process
    would compile with before the manifest's patches: defaults, TORCHINDUCTOR_* variables and
    aotc's fixed config applied."""
    from torch._inductor import config

    values: dict[str, Any] = {}
    with _config_patch({}):
        for name in CONFIG_FACTOR_KEYS:
            obj: Any = config
            try:
                for part in name.split("."):
                    obj = getattr(obj, part)
            except AttributeError:
                continue
            values[name] = obj if isinstance(obj, (bool, int, float, str, type(None))) else repr(obj)
    return values


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
