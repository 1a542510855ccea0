"""The CPU vector-ISA probe libraries Inductor builds before a CPU kernel, built once per
machine and toolchain and seeded into every compile's cache dir: part of the fence around
``torch._inductor``. Written for torch 2.11–2.13, API differences feature-checked; tested on
2.13.0 (CPU).
"""

from __future__ import annotations

import copy
import dataclasses
import os
import shlex
import shutil
import subprocess
import sys
import tempfile
import threading
from pathlib import Path
from typing import Any

from aotc._torch.inductor_facts import _config_patch
from aotc._torch.inductor_load import in_process_isa_probes, inductor_cache_dir
from aotc._torch.inductor_load import kernel_files as _kernel_files
from aotc._torch.scoped_env import process_scope

__all__ = ["isa_probe_files", "keep_isa_probes", "machine_isa_probe_dir", "predicted_isa", "probe_builds",
           "seed_isa_probes"]

EXIT_WAIT = 600.0  # the most seconds a caller waits for the background probe builds

_probe: dict[str, Any] = {}  # the ISA probe libraries of this process (see isa_probe_files)
# the probes a compile with ``cpp.vec_isa_ok`` runs (the ISA extensions only, not every ISA)
_PROBE_SCRIPT = ("from torch._inductor import config; config.cpp.vec_isa_ok = True; "
                 "from torch._inductor.cpu_vec_isa import pick_vec_isa; print(pick_vec_isa())")


def _isa_memos() -> list[Any] | None:
    """Every memo of ``torch._inductor.cpu_vec_isa`` (torch 2.11–2.13: ``pick_vec_isa``,
    ``valid_vec_isa_list`` and the ``functools.cache``'d ``__bool__`` of each ISA class), or
    None when the module is not laid out that way."""
    try:
        from torch._inductor import cpu_vec_isa as m
    except ImportError:
        return None
    memos = [f for f in (getattr(m, "pick_vec_isa", None), getattr(m, "valid_vec_isa_list", None))
             if hasattr(f, "cache_clear")]
    for cls in vars(m).values():
        if isinstance(cls, type) and issubclass(cls, m.VecISA):
            memos += [f for f in vars(cls).values() if hasattr(f, "cache_clear")]
    return memos if len(memos) >= 3 else None


def _probed_flags() -> list[tuple[Any, str]]:
    """(ISA instance, attribute) of each outcome a probe records on Inductor's ISA instances
    (torch 2.11–2.13: ``_is_avx512_bf16_supported``, ``_is_amx_fp16_supported``, set on success
    and never reset). Such a flag enters the next probe's command (``build_arch_flags``), hence
    its library's name: a process that probed once names its probes apart from a fresh one."""
    from torch._inductor import cpu_vec_isa as m

    out = []
    for isa in getattr(m, "supported_vec_isa_list", []):
        fields = {f.name for f in dataclasses.fields(isa)} if dataclasses.is_dataclass(isa) else set()
        out += [(isa, name) for name in vars(isa)
                if name.startswith("_is_") and name.endswith("_supported") and name not in fields]
    return out


def _reset_isa_state(memos: list[Any]) -> None:
    """Put Inductor's ISA detection back as a fresh process has it: memos cleared, the probes'
    recorded outcomes removed (:func:`_probed_flags`), so the next probe, ours or a compile's,
    names its libraries as a fresh process does and finds the ones kept."""
    for f in memos:
        f.cache_clear()
    for isa, name in _probed_flags():
        delattr(isa, name)  # the class's default (False) shows through again


def _probe_here(root: Path) -> bool:
    """Run Inductor's ISA-extension probes in this process with ``root`` as the cache dir: its
    ISA state reset before (so the probes run, and are named, as in a fresh process even if this
    one probed already) and after (so a compile, or a later ``torch.compile`` of the caller's
    own, probes as a fresh process would and finds these libraries), without the start of a
    child interpreter. False when it cannot (another torch layout)."""
    memos = _isa_memos()
    if memos is None:
        return False
    from torch._inductor.cpu_vec_isa import pick_vec_isa

    def clear() -> None:
        _reset_isa_state(memos)

    clear()
    try:
        with inductor_cache_dir(root), _config_patch({}), in_process_isa_probes():  # as compiles
            pick_vec_isa()
    finally:
        clear()
    return True


def predicted_isa() -> Any | None:
    """The vector ISA Inductor's ``pick_vec_isa`` will name once the probes ran, predicted without
    compiling anything: each probe taken to pass where the CPU reports the extension (a probe
    fails only where the compiler cannot build the extension's intrinsics, an old g++), under
    the config compiles use. A copy (so later probes, which change Inductor's instances, leave
    it as it is); the ISA state is reset after (a real probe names its libraries as a fresh
    process). None on another torch layout. Lets the precompiled header, whose command names
    the ISA, start before the probes end (``header_build``)."""
    memos = _isa_memos()
    if memos is None:
        return None
    from torch._inductor.cpu_vec_isa import VecISA, pick_vec_isa

    original = getattr(VecISA, "check_build", None)
    if original is None:
        return None

    def cpu_says_so(self: Any, code: str) -> bool:
        return True  # each caller asked the CPU (torch.cpu._is_*_supported) before building

    with process_scope(), _config_patch({}):
        _reset_isa_state(memos)
        VecISA.check_build = cpu_says_so  # type: ignore[method-assign]  # patched for the block, put back after it
        try:
            return copy.copy(pick_vec_isa())
        finally:
            VecISA.check_build = original  # type: ignore[method-assign]  # patched for the block, put back after it
            _reset_isa_state(memos)


def _probe_in_child(root: Path) -> None:
    env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=str(root))
    env.pop("TRITON_CACHE_DIR", None)
    subprocess.run([sys.executable, "-c", _PROBE_SCRIPT], env=env, check=True,
                   capture_output=True, timeout=600)


def isa_probe_files() -> dict[str, Path]:
    """The vector-ISA probe libraries Inductor builds in its cache dir (relative path -> file).

    Inductor checks the CPU's ISA extensions (AVX512-BF16, VNNI, AMX; the base ISAs are trusted,
    ``cpp.vec_isa_ok``) once per process by compiling a tiny program into the cache dir
    (``cpu_vec_isa.VecISA.check_build``) and skips the compiler when that library already exists.
    Its per-process memo means a compile only writes them the first time, so they are produced
    here once per machine and toolchain (:func:`keep_isa_probes`; else once per process), with
    Inductor's memo cleared around the probe, and seeded into every compile's cache dir (hence
    shipped with every piece, so a load never compiles them). Empty if the probe cannot run.
    A caller in another thread while one probes waits for that probe's files.
    """
    with process_scope():  # one probe per process, also when a background thread runs it
        return _isa_probe_files()


def _isa_probe_files() -> dict[str, Path]:
    kept: Path | None = _probe.get("keep")
    files = _probe.get("files")
    if files is not None and (_probe.get("files_for") != kept or not all(p.is_file() for p in files.values())):
        files = _probe["files"] = None  # another store now, or its files went away: again
    if files is None:
        _probe["files_for"] = kept
        if kept is not None and kept.is_dir():  # built by an earlier process on this toolchain
            _probe["files"] = {rel: kept / rel for rel in _kernel_files(kept)}
            if _probe["files"]:
                return _probe["files"]
        prebuilt = _probe.pop("prebuilt", None)
        if prebuilt is not None:  # built in the background while Dynamo traced: only loaded now
            prebuilt[1].wait(EXIT_WAIT)
            root = prebuilt[0]
        else:
            tmp = tempfile.TemporaryDirectory(prefix="aotc-isa-probe-")
            _probe["dir"] = tmp  # lives as long as the process
            root = Path(tmp.name)
        try:
            try:
                here = _probe_here(root)
            except Exception:  # noqa: BLE001 - another torch's internals: probe in a child instead
                here = False
            if not here:
                _probe_in_child(root)
            _probe["files"] = {rel: root / rel for rel in _kernel_files(root)}
        except (OSError, subprocess.SubprocessError):
            _probe["files"] = {}
        if kept is not None and _probe["files"]:
            _keep_probes(root, kept)
    return _probe["files"]


def probe_builds() -> tuple[list[tuple[list[str], Path, Path]], threading.Event] | None:
    """The ISA probes this process has still to build, as g++ runs for a background thread to
    make while Dynamo traces (:mod:`aotc._torch.kernel_header`): each probe taken to pass, as
    :func:`predicted_isa` does, and its build recorded instead of run (Inductor's own command,
    its library made under a partial name, renamed when whole): ``([(argv, partial, library)],
    done)``. The thread sets ``done`` when it has run them (or given up); the next
    :func:`isa_probe_files` waits for it, then probes as always, in the same directory — a probe
    built finds its library and only loads it, one not built (a wrong guess, a killed run) is
    built then. None when there is nothing to build (probed already, kept for this machine,
    another torch). Writes only the probes' sources, in a directory of its own."""
    kept = _probe.get("keep")
    if _probe.get("files") or "prebuilt" in _probe or (kept is not None and kept.is_dir()):
        return None
    memos = _isa_memos()
    if memos is None:
        return None
    from torch._inductor.cpp_builder import CppBuilder
    from torch._inductor.cpu_vec_isa import VecISA, pick_vec_isa

    if getattr(VecISA, "_probe_load", None) is None:  # torch 2.11.0 loads in a child: not recorded
        return None
    tmp = tempfile.TemporaryDirectory(prefix="aotc-isa-probe-")
    root = Path(tmp.name)
    recorded: list[Any] = []
    original = CppBuilder.build

    def record(self: Any) -> None:
        recorded.append(self)

    with process_scope():
        _reset_isa_state(memos)
        try:
            with inductor_cache_dir(root), _config_patch({}), in_process_isa_probes():
                VecISA._probe_load = lambda self, output_path: True  # type: ignore[method-assign]  # patched for the block: in_process_isa_probes puts it back
                CppBuilder.build = record  # type: ignore[method-assign]  # patched for the block, put back after it
                try:
                    pick_vec_isa()
                finally:
                    CppBuilder.build = original  # type: ignore[method-assign]  # patched for the block, put back after it
        finally:
            _reset_isa_state(memos)
    builds = []
    for b in recorded:
        line, lib = b.get_command_line(), Path(b.get_target_file_path())
        argv = shlex.split(line)
        if argv.count(str(lib)) != 1:
            return None
        partial = lib.with_name(f".{lib.name}.{os.getpid()}.partial")
        builds.append(([str(partial) if a == str(lib) else a for a in argv], partial, lib))
    done = threading.Event()
    _probe["dir"], _probe["prebuilt"] = tmp, (root, done)
    return builds, done


def keep_isa_probes(directory: Path) -> None:
    """Keep the ISA probe libraries in ``directory`` (per toolchain fingerprint, so any change of
    compiler, torch or CPU gives another) and reuse them in later processes: the probe compiles
    a few programs in every compiling process otherwise."""
    _probe["keep"] = Path(directory)


def machine_isa_probe_dir(fingerprint: str) -> Path:
    """Where this machine keeps the ISA probe libraries of one toolchain (``fingerprint``, see
    ``aotc.lookup.toolchain.fingerprint``): beside Inductor's own machine-wide files (its
    precompiled headers) in its default cache dir, ``$TMPDIR/torchinductor_$USER``, so every
    store and every process on the machine builds them once."""
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    return Path(default_cache_dir()) / "aotc-isa-probes" / fingerprint[:32]


def _keep_probes(src: Path, dest: Path) -> None:
    partial = dest.with_name(f"{dest.name}.{os.getpid()}.partial")
    try:
        shutil.rmtree(partial, ignore_errors=True)
        for rel in _kernel_files(src):
            (partial / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src / rel, partial / rel)
        os.rename(partial, dest)  # whole or not at all; a concurrent process may win: fine
    except OSError:
        shutil.rmtree(partial, ignore_errors=True)


def seed_isa_probes(cache_dir: Path, probes: dict[str, Path]) -> None:
    """Copy the ISA probe libraries (:func:`isa_probe_files`) into an Inductor cache dir, where
    the ISA check at compile and at load finds them instead of building them."""
    for rel, src in probes.items():
        (cache_dir / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(src, cache_dir / rel)
