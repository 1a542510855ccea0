"""Inductor's precompiled C++ header, built in the background while a compile traces: part of
the fence around ``torch._inductor``. Written for torch 2.11–2.13, tested on 2.13.0 (CPU).

Every C++ kernel Inductor builds includes one big header (``cpp_prefix.h``, ~150 MB
precompiled); with ``cpp_cache_precompile_headers`` the first kernel of a machine precompiles it
(one long g++ run under a file lock) and every later kernel loads it instead of parsing the
headers again (a fraction of the time). On a cold machine that first build used to wait until
the first piece's first kernel, and after the ISA probes (a few short g++ runs: the header's
command names the ISA they find); :func:`start_header_build` starts it as soon as a compile knows
it will compile, with the ISA predicted from the CPU's flags, so it runs beside the probes, the
Dynamo capture and the split (8 layers, cold machine: 10.2 s → 8.1 s; ``bench.sidebyside``). The
kernels' own builds wait for it on Inductor's lock, and skip it when it exists
(``codecache._worker_compile_cpp``).

The header's name hashes the kernels' build command, so the command is made here exactly as
``CppCodeCache.load_async`` makes it for a CPU kernel (``AsyncCompile.cpp_pybinding``: no extra
flags, the vector ISA of this machine, not minimally optimized). Only with no Inductor options
of the manifest's own: they may change that command. Best effort: if anything differs, the
kernels build the header as before.

The build is a g++ run that Inductor starts from the background thread; a compile can finish
before it does (its kernels did not need the header). Nothing of aotc outlives the call that
started it: the compile that started a build waits for it before it returns
(:func:`wait_for_header_builds`, called by the backend's and the manifest's compile; a few seconds
at most, and the header is then whole for the next process), and an exit in between (the compile
raised) waits too (``atexit``) rather than leave a compiler running behind its caller
(``tests/test_no_leftovers.py``).
"""

from __future__ import annotations

import atexit
import copy
import tempfile
import threading
from pathlib import Path
from typing import Any

from aotc._torch import isa_probes
from aotc._torch.inductor_facts import _config_patch
from aotc._torch.inductor_load import in_process_isa_probes, inductor_cache_dir
from aotc._torch.isa_probes import isa_probe_files, seed_isa_probes

__all__ = ["start_header_build"]


def _header_command(vec_isa: Any = None) -> tuple[Any, str, str, dict[str, Any]] | None:
    """(``_precompile_header``, header, hashable command line, compile command) as a CPU
    kernel's build would pass them, for ``vec_isa`` (default: what ``pick_vec_isa`` names now,
    copied: the build reads its flags later, while a compile may be probing the instance), or
    None where torch is laid out otherwise."""
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
    isa = vec_isa if vec_isa is not None else copy.copy(pick_vec_isa())
    command = {**cls.cpp_compile_command_flags, "device_type": "cpu", "extra_flags": (),
               "use_relative_path": config.is_fbcode(), "vec_isa": isa}
    option = CppTorchDeviceOptions(compile_only=False, min_optimize=False, **command)
    return build, header, CppBuilder(name="o", sources="i", BuildOption=option).get_command_line(), command


def _run(build: Any, header: str, cmd_line: str, command: dict[str, Any]) -> None:
    try:
        build(header, cmd_line, min_optimize=False, **command)
    except Exception:  # noqa: BLE001 - a warm-up only: the first kernel builds it otherwise
        pass


def _command_for(vec_isa: Any, probes: dict[str, Path]) -> tuple[Any, str, str, dict[str, Any]] | None:
    """The header's build (:func:`_header_command`) under the config compiles use, in a scratch
    cache dir seeded with the ISA probe libraries (so naming the ISA compiles nothing)."""
    with tempfile.TemporaryDirectory(prefix="aotc-header-") as tmp:
        seed_isa_probes(Path(tmp), probes)
        with inductor_cache_dir(tmp), _config_patch({}), in_process_isa_probes():
            return _header_command(vec_isa)


# the header builds this process started, by command line: one per command (a server's every
# graph miss asks; a second would only preprocess the header again to find it built)
_started: dict[str, threading.Thread] = {}


# the most seconds an exiting process waits for its header builds (one g++ run: ~5–15 s cold)
EXIT_WAIT = 600.0


def wait_for_header_builds(timeout: float = EXIT_WAIT) -> None:
    """Wait (at most ``timeout`` seconds each) for the header builds this process started
    (module doc): the end of the compile that started them, so that no g++ of aotc's runs on
    after the call."""
    for thread in list(_started.values()):
        thread.join(timeout)


def _wait_at_exit() -> None:
    """At interpreter exit: :func:`wait_for_header_builds` (module doc)."""
    wait_for_header_builds()


def _start(made: tuple[Any, str, str, dict[str, Any]]) -> threading.Thread:
    thread = threading.Thread(target=_run, args=made, name="aotc-header-build", daemon=True)
    if not _started:
        atexit.register(_wait_at_exit)
    _started[made[2]] = thread
    thread.start()
    return thread


def start_header_build(options: dict[str, Any], device: str = "cpu") -> threading.Thread | None:
    """Make the vector-ISA probe libraries (:func:`~aotc._torch.isa_probes.isa_probe_files`, a few
    short g++ runs) and start Inductor's precompiled header for CPU kernels in a background
    thread (see the module doc): the two things the first C++ kernel of a cold machine waits
    for. The header's command names the ISA the probes find, so it starts first with the ISA
    predicted from the CPU's flags (:func:`~aotc._torch.isa_probes.predicted_isa`) and builds
    beside the probes; if the probes name another (a compiler that cannot build an extension),
    a second build starts with theirs — the first was only wasted work, the header's name hashes
    its command. One build per command in a process (a later call returns the first's thread).
    Returns the header's thread, or None when no header build starts (``options``
    of the manifest's own, a ``device`` other than the CPU, another torch, headers off)."""
    if options or not device.startswith("cpu"):
        isa_probe_files()
        return None
    thread = guess = None
    try:
        predicted = isa_probes.predicted_isa()
        guess = _command_for(predicted, {}) if predicted is not None else None
    except Exception:  # noqa: BLE001 - another torch's internals: the header after the probes
        guess = None
    if guess is not None:
        thread = _started.get(guess[2]) or _start(guess)
    probes = isa_probe_files()
    try:
        made = _command_for(None, probes)
    except Exception:  # noqa: BLE001 - another torch's internals: no warm-up
        return thread
    if made is None or (guess is not None and made[2] == guess[2]):
        return thread
    return _started.get(made[2]) or _start(made)
