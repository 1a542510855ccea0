"""aotc's own precompiled header for a compile's batched C++ kernels, built on the core Dynamo's
trace leaves idle: part of the fence around ``torch._inductor``. Written for torch 2.11–2.13,
tested on 2.13.0 (CPU).

Why. A compile's CPU kernels are built as one translation unit (:mod:`aotc._torch.kernel_batch`),
and most of that g++ run parses the headers every Inductor kernel includes (``Python.h``,
``cpp_prefix.h``): at the 0.5B bench model 1.3 of its 2.0 s; with a precompiled header the same
batch builds in 0.8 s. Precompiling the header takes ~4 s (~150 MB), longer than the parse it
saves, so the backend keeps Inductor's own header off (``aotc.backend.config.DEFAULT_INDUCTOR``):
it is called after Dynamo's trace and would wait for it. But while Dynamo traces, a second core
idles (the trace is one Python thread): 3.5 s at 0.5B.

What. When Dynamo starts compiling in a process that resolved aotc's backend (:func:`speculate`,
from a Dynamo start callback), on a machine without the header for the command the kernels will
be built with (predicted: the CPU's vector ISA, the backend's options), the header's g++ run
starts at the lowest priority (``nice 19``: it takes idle time only). How the batch is then built
with it, racing it or without it is :mod:`aotc._torch.batch_build`'s. The kernels are the same
text either way (the header holds only lines the batch opens with), so the key does not depend
on it.

Where. Kept per machine beside Inductor's own headers (``$TMPDIR/torchinductor_$USER/aotc-pch``),
by the kernel command, the header's lines and the toolchain it was parsed from — the machine's
toolchain fingerprint (``aotc.lookup.toolchain.fingerprint``: compiler, torch and its files, CPU),
which the compile's entry hands down (:func:`keep_headers`, :func:`speculate`) as it hands the
ISA probes their directory; a process that was handed none builds no header. So a torch
upgraded in place gets another; g++ itself refuses a header built by another compiler or with
other flags and reads the text instead.

Nothing outlives the compile: Dynamo's end callback (:func:`cancel`) kills what still runs — a
header is renamed into place whole or not at all — and so does the interpreter's exit.
"""

from __future__ import annotations

import atexit
import contextlib
import fcntl
import hashlib
import json
import logging
import os
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

__all__ = ["HEAD", "cancel", "header_dir", "job_for", "keep_headers", "kernel_command_template", "kill", "popen",
           "reap", "speculate", "start"]

SRC, OUT = "\0SRC\0", "\0OUT\0"  # a kernel command's source and library, as kernel_batch marks them

# What the header holds: the lines every Inductor CPU kernel (a Python binding) opens with.
HEAD = ("#define PY_SSIZE_T_CLEAN", "#include <Python.h>", "#include <torch/csrc/inductor/cpp_prefix.h>")

_log = logging.getLogger("aotc.kernel_header")
_lock = threading.Lock()
_background: set[subprocess.Popen[bytes]] = set()  # the header builds' g++ runs (killed by cancel)
_jobs: dict[Path, _Job] = {}  # header builds this process started, by header dir
_threads: list[threading.Thread] = []  # this module's background threads (joined by cancel)
_state: dict[str, Any] = {}  # the predicted kernel command (speculate), computed once


class _Job:
    """One header build of this process: ``done`` when it ended, ``ok`` when the header is there."""

    def __init__(self, directory: Path) -> None:
        self.dir, self.done, self.ok = directory, threading.Event(), False
        self.seconds: float | None = None  # how long its g++ run took (None: built by another process)


def job_for(directory: Path) -> _Job | None:
    """This process's header build for ``directory`` (running or ended), if it started one."""
    return _jobs.get(directory)


def keep_headers(machine: str) -> None:
    """Key this process's headers by ``machine``, the toolchain's fingerprint (module doc)."""
    _state["machine"] = machine


def header_dir(template: str) -> Path | None:
    """Where this machine keeps the header for kernels built by ``template`` (module doc); None
    in a process no toolchain fingerprint was handed to."""
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    machine = _state.get("machine")
    if machine is None:
        return None
    digest = hashlib.sha256(json.dumps([template, HEAD, machine]).encode()).hexdigest()
    return Path(default_cache_dir()) / "aotc-pch" / digest[:32]


def _header_argv(template: str, head: Path, out: Path) -> list[str] | None:
    """The kernel command made to precompile ``head`` into ``out``: the source is the header (as
    C++), nothing is linked; every compile flag as the kernels have it (g++ checks them)."""
    tokens = shlex.split(template)
    if tokens.count(SRC) != 1 or tokens.count(OUT) != 1:
        return None
    argv: list[str] = []
    for t in tokens:
        if t == SRC:
            argv += ["-x", "c++-header", str(head)]
        elif t == OUT:
            argv.append(str(out))
        elif t != "-shared" and not t.startswith(("-l", "-L")):
            argv.append(t)
    return argv


# a process group of its own in the caller's session (Python >= 3.11), else a session of its own
_OWN_GROUP: dict[str, Any] = {"process_group": 0} if sys.version_info >= (3, 11) else {"start_new_session": True}


def popen(argv: list[str], cwd: Path, background: bool) -> subprocess.Popen[bytes] | None:
    """Start ``argv`` in a process group of its own (killed with its children); a ``background``
    run (a header build) at the lowest priority, tracked for :func:`cancel`, and not after it.

    The group stays in the caller's session: a session of its own is a scheduling autogroup of
    its own where the kernel has them (``/proc/sys/kernel/sched_autogroup_enabled``, on by
    default on desktop and many server kernels), and the kernel shares CPU between autogroups
    before it looks at nice values — a ``nice 19`` header build in its own session took half a
    core from the caller's own threads (an eager forward of the 0.5B bench model, two threads:
    0.25 s → 2.6 s while it ran); in the caller's group it takes idle time only. Python 3.10
    (no ``process_group``): a session of its own whose autogroup is niced instead."""
    nice = shutil.which("nice") if background else None
    with _lock:
        if background and _state.get("cancelled"):
            return None
        p = subprocess.Popen([nice, "-n", "19", *argv] if nice else argv, cwd=cwd, stdin=subprocess.DEVNULL,
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, **_OWN_GROUP)
        if background:
            _background.add(p)
            if "start_new_session" in _OWN_GROUP:
                _nice_autogroup(p.pid)
    return p


def _nice_autogroup(pid: int) -> None:
    """Lower the scheduling autogroup of ``pid`` (a session leader) to nice 19, where the kernel
    has autogroups; best effort."""
    with contextlib.suppress(OSError):
        Path(f"/proc/{pid}/autogroup").write_text("19")


def reap(p: subprocess.Popen[bytes]) -> int:
    try:
        return p.wait()
    finally:
        with _lock:
            _background.discard(p)


def kill(p: subprocess.Popen[bytes]) -> None:
    """End a run and what it started: TERM first (the g++ driver then removes its temporary
    files), KILL a second later."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        with contextlib.suppress(OSError):
            os.killpg(p.pid, sig)
        with contextlib.suppress(subprocess.TimeoutExpired):
            p.wait(1.0)
            break
    reap(p)


Before = Sequence[tuple[list[str], Path, Path]]  # g++ runs to make first: (argv, partial file, final file)


def _run_before(before: Before, done: threading.Event | None) -> None:
    """The runs the header's thread makes first (the ISA probes'), each renamed into place when
    whole; ``done`` set after them, however they end."""
    try:
        for argv, partial, final in before:
            p = popen(argv, final.parent, background=True)
            if p is None:
                return
            try:
                if reap(p) == 0 and partial.is_file():
                    os.replace(partial, final)
            finally:
                partial.unlink(missing_ok=True)
    except OSError:
        return
    finally:
        if done is not None:
            done.set()


def _build_header(job: _Job, template: str, before: Before, before_done: threading.Event | None) -> None:
    _run_before(before, before_done)
    partial = job.dir / f"head.h.gch.{os.getpid()}.partial"
    try:
        job.dir.mkdir(parents=True, exist_ok=True)
        with open(job.dir / ".lock", "w") as lock:
            try:
                fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:
                return  # another process builds it: this one builds its kernels without
            head = job.dir / "head.h"
            if not (job.dir / "head.h.gch").is_file():
                tmp = head.with_name(f"head.h.{os.getpid()}.tmp")
                tmp.write_text("\n".join(HEAD) + "\n", encoding="utf-8")
                os.replace(tmp, head)
                argv = _header_argv(template, head, partial)
                t = time.perf_counter()
                p = popen(argv, job.dir, background=True) if argv else None
                if p is None or reap(p) != 0 or not partial.is_file():
                    return
                os.replace(partial, job.dir / "head.h.gch")
                job.seconds = time.perf_counter() - t
                _log.debug("aotc: kernels' precompiled header built in %.2fs (%s)", time.perf_counter() - t, job.dir)
            job.ok = True
    except OSError:
        return
    finally:
        partial.unlink(missing_ok=True)
        job.done.set()


def start(template: str | None, before: Before = (), before_done: threading.Event | None = None) -> _Job | None:
    """Start one background thread: the g++ runs ``before`` (then ``before_done`` is set), then
    the header for kernels built by ``template`` unless it is built or being built (one build
    per header in a process). The header's job (this one's or the one already running), or None
    when the header is built."""
    directory = header_dir(template) if template is not None else None
    template = template if directory is not None else None
    job = running = None
    with _lock:
        _state["cancelled"] = False
        if directory is not None and not (directory / "head.h.gch").is_file():
            running = _jobs.get(directory)
            if running is None or running.done.is_set():
                job = _jobs[directory] = _Job(directory)
    if job is None and not before:
        return running

    def work() -> None:
        if job is None:
            _run_before(list(before), before_done)
        else:
            _build_header(job, template or "", list(before), before_done)

    thread = threading.Thread(target=work, name="aotc-kernel-header", daemon=True)
    with _lock:
        _threads.append(thread)
    thread.start()
    return job or running


def cancel() -> None:
    """Kill every g++ run of this module and wait for its threads (the end of the compile that
    started them; the interpreter's exit)."""
    with _lock:
        _state["cancelled"] = True
        procs, threads = list(_background), list(_threads)
    for p in procs:
        kill(p)
    for thread in threads:
        thread.join()
    with _lock:
        _threads[:] = [t for t in _threads if t.is_alive()]


atexit.register(cancel)


def kernel_command_template(vec_isa: Any, options: dict[str, Any]) -> str | None:
    """The command Inductor builds a CPU kernel (a Python binding that needs the vector ISA) with,
    under aotc's compile config and ``options``, its source and library marked (``SRC``, ``OUT``)
    as :mod:`~aotc._torch.kernel_batch` marks them; None on another torch layout."""
    from torch._inductor import codecache, config
    from torch._inductor.cpp_builder import CppBuilder, CppTorchDeviceOptions

    from aotc._torch.inductor_facts import _config_patch

    cls = getattr(codecache, "CppPythonBindingsCodeCache", None)
    if cls is None:
        return None
    with tempfile.TemporaryDirectory(prefix="aotc-kernel-cmd-") as tmp, _config_patch(options):
        command = {**cls.cpp_compile_command_flags, "device_type": "cpu", "extra_flags": (),
                   "use_relative_path": config.is_fbcode(), "vec_isa": vec_isa}
        src = os.path.join(tmp, "caotckernel.main.cpp")
        builder = CppBuilder(name="caotckernel.main", sources=src, output_dir=tmp,
                             BuildOption=CppTorchDeviceOptions(compile_only=False, min_optimize=False, **command))
        line, out = builder.get_command_line(), builder.get_target_file_path()
    if line.count(src) != 1 or line.count(out) != 1:
        return None
    return line.replace(src, SRC).replace(out, OUT)


def speculate(options: dict[str, Any], machine: Callable[[], str | None]) -> None:
    """Start the ISA probes' builds and the header's (module doc) on a machine that lacks them,
    decided once per process (``machine`` is asked then, and only then: the toolchain's
    fingerprint to key the header by, None to start nothing): the kernel command predicted from
    the CPU's flags and ``options`` (the backend's Inductor options). Never on a machine with
    CUDA. Best effort: anything unexpected, nothing starts."""
    if "template" in _state:
        return
    _state["template"] = None
    try:
        fingerprint = machine()
        if fingerprint is None:
            return
        keep_headers(fingerprint)
        import torch

        if torch.cuda.is_available():
            return
        from aotc._torch.isa_probes import predicted_isa, probe_builds

        isa = predicted_isa()
        template = kernel_command_template(isa, options) if isa is not None else None
        _state["template"] = template
        probes = probe_builds()
        if template is not None or probes is not None:
            before, done = probes if probes is not None else ([], None)
            start(template, before, done)
    except Exception:  # noqa: BLE001 - a speculation: the probes and kernels build as before
        return
