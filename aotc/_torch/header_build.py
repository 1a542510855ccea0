"""Inductor's precompiled C++ header, built in the background while a compile traces: part of
the fence around ``torch._inductor``. Written for torch 2.11–2.13, tested on 2.13.0 (CPU).

Every C++ kernel Inductor builds includes one big header (``cpp_prefix.h``, ~150 MB
precompiled); with ``cpp_cache_precompile_headers`` the first kernel of a machine precompiles it
(one long g++ run under a file lock) and every later kernel loads it instead of parsing the
headers again (a fraction of the time). On a cold machine that first build used to wait until
the first piece's first kernel; :func:`start_header_build` starts it as soon as a compile knows
it will compile, so it runs beside the Dynamo capture and the split. The kernels' own builds wait
for it on Inductor's lock, and skip it when it exists (``codecache._worker_compile_cpp``).

The header's name hashes the kernels' build command, so the command is made here exactly as
``CppCodeCache.load_async`` makes it for a CPU kernel (``AsyncCompile.cpp_pybinding``: no extra
flags, the vector ISA of this machine, not minimally optimized). Only with no Inductor options
of the manifest's own: they may change that command, and reading them means patching Inductor's
config while the main thread traces. Best effort: if anything differs, the kernels build the
header as before.
"""

from __future__ import annotations

import tempfile
import threading
from pathlib import Path
from typing import Any

from aotc._torch.inductor_facts import _config_patch
from aotc._torch.inductor_load import in_process_isa_probes, inductor_cache_dir
from aotc._torch.isa_probes import seed_isa_probes

__all__ = ["start_header_build"]


def _header_command() -> tuple[Any, str, str, dict[str, Any]] | None:
    """(``_precompile_header``, header, hashable command line, compile command) as a CPU
    kernel's build would pass them, or None where torch is laid out otherwise."""
    from torch._inductor import codecache, config
    from torch._inductor.cpp_builder import CppBuilder, CppTorchDeviceOptions
    from torch._inductor.cpu_vec_isa import pick_vec_isa

    cls = getattr(codecache, "CppPythonBindingsCodeCache", None)
    build = getattr(codecache, "_precompile_header", None)
    if cls is None or build is None or not config.cpp_cache_precompile_headers:
        return None
    header = cls._get_uncompiled_header("cpu")
    if header is None:
        return None
    command = {**cls.cpp_compile_command_flags, "device_type": "cpu", "extra_flags": (),
               "use_relative_path": config.is_fbcode(), "vec_isa": pick_vec_isa()}
    option = CppTorchDeviceOptions(compile_only=False, min_optimize=False, **command)
    return build, header, CppBuilder(name="o", sources="i", BuildOption=option).get_command_line(), command


def _run(build: Any, header: str, cmd_line: str, command: dict[str, Any]) -> None:
    try:
        build(header, cmd_line, min_optimize=False, **command)
    except Exception:  # noqa: BLE001 - a warm-up only: the first kernel builds it otherwise
        pass


def start_header_build(options: dict[str, Any], isa_probes: dict[str, Path]) -> threading.Thread | None:
    """Start building Inductor's precompiled header for CPU kernels in a background thread (see
    the module doc); None when it is not started (``options`` given, another torch, headers off).
    ``isa_probes``: the ISA probe libraries (relative path -> file), so naming the vector ISA
    here compiles nothing."""
    if options:
        return None
    with tempfile.TemporaryDirectory(prefix="aotc-header-") as tmp:
        seed_isa_probes(Path(tmp), isa_probes)
        try:
            with inductor_cache_dir(tmp), _config_patch({}), in_process_isa_probes():
                made = _header_command()
        except Exception:  # noqa: BLE001 - another torch's internals: no warm-up
            return None
    if made is None:
        return None
    thread = threading.Thread(target=_run, args=made, name="aotc-header-build", daemon=True)
    thread.start()
    return thread
