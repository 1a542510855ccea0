"""The C++ kernels of one compiled piece built by one compiler run: part of the fence around
``torch._inductor``. Written for torch 2.11–2.13, tested on 2.11.0 and 2.13.0 (CPU).

Inductor builds every CPU kernel of a generated module as its own library, one g++ run each
(``AsyncCompile.cpp_pybinding`` → ``CppCodeCache.load_async`` → ``_worker_compile_cpp``). With
the precompiled header on, most of such a run is fixed cost — loading the ~150 MB header and
starting the compiler, most of a small kernel's build — so kernels built together cost little
more than one (``make bench`` measures it).

Within :func:`batched_builds`, the kernels a module defines are not submitted one by one: their
builds are held until the module waits for the first of them, then built as ONE translation
unit — each kernel's source (its Python binding included) in a namespace of its own, the
includes once at the top — by the very command Inductor made for the first one. The library is
then linked at every kernel's own path (``<key>.main.so``), so everything that finds a kernel by
its key finds it there: Inductor's loader, aotc's fast path, the kernel pool, the store (which
keeps the one library once: the bytes are the same). Its init function is multi-phase and
answers each import with the kernel whose file name it was imported under.

Only kernels whose source has the shape this relies on are batched (one ``extern "C" void
kernel(``, one ``PyInit_kernel``, no preprocessor lines but includes (outside conditionals),
conditionals, pragmas and macro definitions the same in every kernel of the batch — torch 2.11
defines ``likely``/``unlikely`` in each, an identical redefinition is legal C++ — and the same
build command but for the paths); a batch whose build fails is built kernel by kernel, as
Inductor would have.
"""

from __future__ import annotations

import contextlib
import os
import re
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from aotc._torch import batch_build

__all__ = ["KernelBatch", "batched_builds", "sharing_cores"]

_KERNEL_DEF = re.compile(r'extern\s+"C"\s+void\s+kernel\(')
_INIT_DEF = "PyMODINIT_FUNC PyInit_kernel(void)"
_HOISTED = re.compile(r"^\s*(#include\s*[<\"].*[>\"]|#define PY_SSIZE_T_CLEAN)\s*$")
_KEPT = re.compile(r"^\s*#\s*(pragma|if|ifdef|ifndef|elif|else|endif)\b")
_DEFINE = re.compile(r"^\s*#\s*define\s")
_OPENS, _CLOSES = re.compile(r"^\s*#\s*if"), re.compile(r"^\s*#\s*endif\b")

_DISPATCH = """
static PyObject* aotc_create(PyObject* spec, PyModuleDef* def) {
    PyObject* origin = PyObject_GetAttrString(spec, "origin");
    if (origin == NULL) return NULL;
    const char* path = PyUnicode_AsUTF8(origin);
    if (path == NULL) { Py_DECREF(origin); return NULL; }
    const char* base = strrchr(path, '/');
    base = base ? base + 1 : path;
    PyObject* module = NULL;
    bool found = false;
%s
    if (!found) PyErr_Format(PyExc_ImportError, "aotc kernel batch: no kernel named %%s here", base);
    Py_DECREF(origin);
    return module;
}
static PyModuleDef_Slot aotc_slots[] = {{Py_mod_create, (void*)aotc_create}, {0, NULL}};
static struct PyModuleDef aotc_def = {PyModuleDef_HEAD_INIT, "kernel", NULL, 0, NULL, aotc_slots,
                                      NULL, NULL, NULL};
PyMODINIT_FUNC PyInit_kernel(void) { return PyModuleDef_Init(&aotc_def); }
"""


def combine(sources: list[tuple[str, str]]) -> str | None:
    """One translation unit from ``(library file name, full kernel source)`` pairs, or None
    when a source is not shaped as :mod:`this module <aotc._torch.kernel_batch>` expects."""
    head: list[str] = ["#include <cstring>"]
    bodies: list[str] = []
    cases: list[str] = []
    defines: list[str] | None = None  # every kernel's macro definitions: the same, or no batch
    for i, (name, text) in enumerate(sources):
        if len(_KERNEL_DEF.findall(text)) != 1 or text.count(_INIT_DEF) != 1 or '"' in name:
            return None
        mine = [" ".join(line.split()) for line in text.splitlines()
                if _DEFINE.match(line) and not _HOISTED.match(line)]
        if defines is not None and mine != defines:
            return None
        defines = mine
        lines, depth = [], 0
        for line in text.splitlines():
            if _HOISTED.match(line):
                if depth:  # an include under a condition stays where it is: not batched
                    return None
                if line.strip() not in head:
                    head.append(line.strip())
            elif line.lstrip().startswith("#") and not (_KEPT.match(line) or _DEFINE.match(line)):
                return None
            else:
                depth += bool(_OPENS.match(line)) - bool(_CLOSES.match(line))
                lines.append(line)
        if depth:
            return None
        body = "\n".join(lines)
        body = _KERNEL_DEF.sub("void kernel(", body).replace(_INIT_DEF, "PyObject* init_kernel(void)")
        bodies.append(f"namespace aotc_k{i} {{\n{body}\n}}  // namespace aotc_k{i}")
        cases.append(f'    if (!found && strcmp(base, "{name}") == 0) '
                     f"{{ found = true; module = aotc_k{i}::init_kernel(); }}")
    # the binding's own define must come before Python.h, which the dispatcher needs
    head.sort(key=lambda line: (not line.startswith("#define"), line != "#include <Python.h>"))
    if "#include <Python.h>" not in head:
        return None
    return "\n".join(head + bodies + [_DISPATCH % "\n".join(cases)]) + "\n"


class KernelBatch:
    """The kernel builds held so far; built together when the first is waited for, or when
    :meth:`build` is called (a batch given to :func:`batched_builds` spans several compiles)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.pending: list[tuple[Any, _Held]] = []
        # library paths that got a library built for another compile of the same kernel
        self.linked: set[Path] = set()

    def defer(self, worker_fn: Any) -> Any:
        """``submit_fn`` for ``load_async``: hold the build; the returned future builds it."""
        held = _Held(self)
        with self.lock:
            self.pending.append((worker_fn, held))
        return held

    def build(self) -> None:
        """Build every held kernel now (one compiler run per build command)."""
        with self.lock:
            pending, self.pending = self.pending, []
            if not pending:
                return
            try:
                _build_together([w for w, _ in pending], self.linked)
            finally:
                for _, held in pending:
                    held.done = True


class _Held:
    """The future ``load_async`` keeps for a held build (it calls ``.result()`` before loading)."""

    def __init__(self, batch: KernelBatch) -> None:
        self.batch, self.done = batch, False

    def result(self, timeout: float | None = None) -> None:
        if not self.done:
            self.batch.build()


def _builder_of(worker_fn: Any) -> tuple[str, Any] | None:
    """(lock path, the one CppBuilder) of Inductor's ``partial(_worker_compile_cpp, lock, (b,))``."""
    args: tuple[Any, ...] = tuple(getattr(worker_fn, "args", ()))
    if len(args) == 2 and isinstance(args[1], tuple) and len(args[1]) == 1:
        return args[0], args[1][0]
    return None


def _build_together(worker_fns: list[Any], linked: set[Path]) -> None:
    """Build held kernels: those that share a build command as one library, the rest alone.
    The paths given a copy of a library built for another compile are added to ``linked``."""
    from torch._inductor.cpp_builder import run_compile_cmd

    groups: dict[str, list[tuple[Any, str, Path, Path]]] = {}
    alone: list[Any] = []
    for fn in worker_fns:
        found = _builder_of(fn)
        if found is None:
            alone.append(fn)
            continue
        lock, builder = found
        out = Path(builder.get_target_file_path())
        src = out.with_suffix(".cpp")
        cmd = builder.get_command_line()
        if out.exists() or not src.is_file() or str(src) not in cmd or str(out) not in cmd:
            alone.append(fn)
            continue
        groups.setdefault(cmd.replace(str(src), "\0SRC\0").replace(str(out), "\0OUT\0"),
                          []).append((fn, lock, src, out))
    for command, members in groups.items():
        # one kernel held by several compiles (its library at the same name in each cache dir):
        # compiled once, linked at every path
        first: dict[str, tuple[Any, str, Path, Path]] = {}
        for m in members:
            first.setdefault(m[3].name, m)
        unique = list(first.values())
        if len(unique) == 1 and len(members) > 1 and _link_copies(unique[0], members):
            linked.update(m[3].resolve() for m in members if m is not unique[0])
            continue
        if len(unique) > 1 and _try_group(command, unique, run_compile_cmd, members):
            linked.update(m[3].resolve() for m in members if first[m[3].name] is not m)
            continue
        alone += [fn for fn, *_ in members]
    for fn in alone:
        fn()


def _link_copies(built: tuple[Any, str, Path, Path], members: list[tuple[Any, str, Path, Path]]) -> bool:
    """Build one kernel as Inductor would, then link its library at the other members' paths."""
    built[0]()
    lib = built[3]
    if not lib.is_file():
        return False
    _link_at_every_path(lib, [m for m in members if m[3] != lib])
    return True


def _link_at_every_path(lib: Path, every: list[tuple[Any, str, Path, Path]]) -> None:
    """Hard-link ``lib`` at each member's library path (under its kernel's lock), unless one is
    there already."""
    from torch.utils._filelock import FileLock

    for _, lock, _, out in every:
        with FileLock(lock, timeout=600):
            if not out.exists():
                partial = out.with_name(f".{out.name}.{os.getpid()}.partial")
                os.link(lib, partial)
                os.replace(partial, out)


def _try_group(command: str, members: list[tuple[Any, str, Path, Path]], run: Any,
               every: list[tuple[Any, str, Path, Path]]) -> bool:
    """Build ``members`` (distinct kernels) as one library, linked at the path of each of
    ``every`` (the members and their copies in other cache dirs) — or, where the header makes
    that faster (:func:`aotc._torch.batch_build.build`), as one library per part of them
    (:func:`_parts`), each linked at its own members' paths; False if it did not build."""
    first_out = members[0][3]
    sources = {out.name: src.read_text(encoding="utf-8") for _, _, src, out in members}
    text = combine(list(sources.items()))
    if text is None:
        return False
    stem = first_out.name.removesuffix(".so")
    src = first_out.with_name(f".{stem}.batch{os.getpid()}.cpp")
    lib = first_out.with_name(f".{stem}.batch{os.getpid()}.so")
    build_dir = first_out.with_name(f".{stem}.batch{os.getpid()}.build")
    groups = _parts([out.name for _, _, _, out in members], sources)
    texts = [combine([(n, sources[n]) for n in g]) for g in groups]
    parts = [(t, src.with_name(f"{src.stem}.part{i}.cpp"), lib.with_name(f"{lib.stem}.part{i}.so"))
             for i, t in enumerate(texts) if t is not None] if len(groups) > 1 else []
    parts = parts if len(parts) == len(groups) else []
    try:
        src.write_text(text, encoding="utf-8")
        build_dir.mkdir(exist_ok=True)
        try:  # with aotc's header if built
            in_parts = batch_build.build(command, text, src, lib, build_dir, run, parts)
        except Exception:  # noqa: BLE001 - built one by one instead (a kernel's own error shows there)
            return False
        if in_parts:
            for names, (_, _, part_lib) in zip(groups, parts):
                _link_at_every_path(part_lib, [m for m in every if m[3].name in names])
        else:
            _link_at_every_path(lib, every)
        return True
    finally:
        for p in (src, lib, *(part_lib for _, _, part_lib in parts)):
            p.unlink(missing_ok=True)
        with contextlib.suppress(OSError):
            build_dir.rmdir()


_AT_ONCE = [1]  # compiles of this job building kernels at once (sharing_cores)


@contextlib.contextmanager
def sharing_cores(builds: int) -> Iterator[None]:
    """Within the block (and in processes forked in it), ``builds`` compiles build kernels at once:
    a batch is parted for its share of the cores only (a worker per core: one part each, as
    before — more would only add each part's fixed cost, loading the header)."""
    before = _AT_ONCE[0]
    _AT_ONCE[0] = max(1, builds)
    try:
        yield
    finally:
        _AT_ONCE[0] = before


def _parts(names: list[str], sources: dict[str, str]) -> list[list[str]]:
    """The kernels ``names`` in as many parts as this compile's share of the process's cores
    (:func:`sharing_cores`; at most 4, at least one kernel each), balanced by source length
    (largest first, each to the lightest part)."""
    try:
        cores = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cores = os.cpu_count() or 1
    n = max(1, min(cores // _AT_ONCE[0], len(names), 4))
    groups: list[list[str]] = [[] for _ in range(n)]
    sizes = [0] * n
    for name in sorted(names, key=lambda k: -len(sources[k])):
        i = sizes.index(min(sizes))
        groups[i].append(name)
        sizes[i] += len(sources[name])
    return groups


class _Lazy:
    """A kernel whose build is held, for Inductor without a thread pool (which wants the kernel
    itself, not a future): built, with the others held, at its first call or when the block of
    :func:`batched_builds` ends, whichever is first."""

    def __init__(self, get_result: Any) -> None:
        self._get, self._fn = get_result, None

    def __call__(self, *args: Any) -> Any:
        fn = self._fn
        if fn is None:
            fn = self._fn = self._get()
        return fn(*args)


@contextlib.contextmanager
def batched_builds(batch: KernelBatch | None = None) -> Iterator[None]:
    """Within the block, the CPU kernels of each generated module are built by one compiler run
    (module doc); every build still held is done when the block ends. With a ``batch`` of the
    caller's, the kernels are held in it instead — never waited for by the module (each resolves
    at its first call) — until the caller builds it: the kernels of several compiles, one run."""
    try:
        from torch._inductor.async_compile import AsyncCompile, get_compile_threads
        from torch._inductor.codecache import CppPythonBindingsCodeCache, LambdaFuture
    except ImportError:
        yield
        return
    original = AsyncCompile.cpp_pybinding
    held_by_caller = batch is not None
    batch = batch if batch is not None else KernelBatch()

    def cpp_pybinding(self: Any, argtypes: list[str], source_code: str, *rest: Any, **kw: Any) -> Any:
        if rest or kw:  # another torch's call: Inductor's own way
            return original(self, argtypes, source_code, *rest, **kw)
        try:
            get_result = CppPythonBindingsCodeCache.load_pybinding_async(
                argtypes, source_code, submit_fn=batch.defer)
        except TypeError:  # another torch's signature: Inductor's own way
            return original(self, argtypes, source_code)
        if get_compile_threads() > 1 and not held_by_caller:
            return LambdaFuture(get_result)  # the module waits for it
        return _Lazy(get_result)  # no thread pool (vLLM sets 1): resolved at its first call

    AsyncCompile.cpp_pybinding = cpp_pybinding  # type: ignore[method-assign]  # patched for the block, put back after it
    try:
        yield
    finally:
        AsyncCompile.cpp_pybinding = original  # type: ignore[method-assign]  # patched for the block, put back after it
    if not held_by_caller:
        batch.build()  # what is still held (without a thread pool: all of it) is built now
