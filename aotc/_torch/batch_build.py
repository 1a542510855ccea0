"""How a compile's kernel batch (:mod:`aotc._torch.kernel_batch`) is built with aotc's precompiled
header (:mod:`aotc._torch.kernel_header`): part of the fence around ``torch._inductor``. Written
for torch 2.11–2.13, tested on 2.13.0 (CPU).

The header built → the batch includes it first, in parts (one compiler run per idle core: with
the header a run is mostly its own kernels, so two halves take ~0.7 of the whole); being built →
the wait is first used to collect the compile's garbage (:func:`aotc.gc_pause.collect_in_wait`:
work the caller would otherwise pay after the call; the parts' runs are used so when the header
is there), then the batch builds without it and, once
the header is built, either with it (whole: the first build to end is kept, the other killed)
or — the plain build young enough — in parts, the plain one killed; none → as before. The
kernels are the same text either way.
"""

from __future__ import annotations

import logging
import os
import re
import shlex
import subprocess
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from aotc._torch.kernel_header import HEAD, OUT, SRC, header_dir, job_for, kill, popen, reap
from aotc.gc_pause import collect_in_wait

__all__ = ["SWITCH_TO_PARTS", "Part", "build", "last_build"]

# lines a batch may have before its ``cpp_prefix.h`` include and still take the header first
_BEFORE_PREFIX = re.compile(r"^(#define PY_SSIZE_T_CLEAN|#include <[A-Za-z_0-9]+(\.h)?>)$")
_log = logging.getLogger("aotc.kernel_header")
_state: dict[str, Any] = {}  # how the last batch was built


def _usable(text: str) -> bool:
    """Whether the batch ``text`` opens with the header's lines, nothing before its
    ``cpp_prefix.h`` but those and standard headers (so the header, parsed first, means what
    the text means)."""
    lines = text.splitlines()
    if HEAD[2] not in lines or not all(h in lines for h in HEAD):
        return False
    return all(_BEFORE_PREFIX.match(line) for line in lines[:lines.index(HEAD[2])])


Part = tuple[str, Path, Path]  # one part of a batch: (its text, its source file, its library)

# A plain batch build takes about 0.4 of the header's own build on the machines measured (both
# are mostly the parse of the same headers), the batch in parts with the header about 0.15: a
# plain build that ran less than this share of the header's build is worth killing for the parts.
SWITCH_TO_PARTS = 0.25


def build(template: str, text: str, src: Path, lib: Path, cwd: Path, run: Callable[..., None],
          parts: Sequence[Part] = ()) -> bool:
    """Build the batch ``text`` (written at ``src``) into ``lib`` by ``template`` (``run`` is
    Inductor's ``run_compile_cmd``); with the header where it is built or being built (module
    doc). With the header, the batch is built as ``parts`` instead where given (the same kernels
    split into several texts, one compiler run each, side by side on the idle cores: a run with
    the header is mostly its own kernels, so two halves take ~0.7 of the whole): True when it
    was (each part's library made, ``lib`` not). Raises as ``run`` does when the batch does not
    build."""
    plain = template.replace(SRC, str(src)).replace(OUT, str(lib))
    directory = header_dir(template) if _usable(text) else None
    job = job_for(directory) if directory is not None else None
    ready = directory is not None and (directory / "head.h.gch").is_file()
    if not ready and job is not None and not job.done.is_set() and collect_in_wait():
        ready = (job.dir / "head.h.gch").is_file()  # the wait's first use; it may have landed
    if not ready and (job is None or job.done.is_set()):
        _state["last"] = "plain"
        run(plain, cwd=str(cwd))
        return False
    assert directory is not None
    include = f'#include "{directory / "head.h"}"\n'
    with_src, with_lib = src.with_name(f"{src.stem}.pch.cpp"), lib.with_name(f"{lib.stem}.pch.so")
    with_cmd = template.replace(SRC, str(with_src)).replace(OUT, str(with_lib))
    split = [(template.replace(SRC, str(part_src)).replace(OUT, str(part_lib)), part_src, part_text)
             for part_text, part_src, part_lib in parts if _usable(part_text)] if len(parts) > 1 else []
    split = split if len(split) == len(parts) else []
    try:
        with_src.write_text(include + text, encoding="utf-8")
        for _, part_src, part_text in split:
            part_src.write_text(include + part_text, encoding="utf-8")
        if ready:
            t = time.perf_counter()
            if split and _build_parts([c for c, _, _ in split], cwd):
                _state["last"] = "header, in parts"
                _log.debug("aotc: kernel batch with the header, in %d parts, in %.2fs", len(split),
                           time.perf_counter() - t)
                return True
            _state["last"] = "header"
            try:
                run(with_cmd, cwd=str(cwd))
            except Exception:  # noqa: BLE001 - built without the header instead
                _state["last"] = "plain"
                run(plain, cwd=str(cwd))
                return False
            os.replace(with_lib, lib)
            return False
        assert job is not None
        t = time.perf_counter()
        in_parts = _race(plain, with_cmd, job, cwd, lambda: os.replace(with_lib, lib),
                         [c for c, _, _ in split])
        _log.debug("aotc: kernel batch %s in %.2fs", _state.get("last"), time.perf_counter() - t)
        return in_parts
    finally:
        for p in (with_src, with_lib, *(part_src for _, part_src, _ in split)):
            p.unlink(missing_ok=True)


def _build_parts(commands: list[str], cwd: Path) -> bool:
    """Run every part's command at once — the compile's garbage collected meanwhile
    (:func:`aotc.gc_pause.collect_in_wait`: the compilers take the cores, this process would
    only wait) — True when all built (else what still runs is killed)."""
    procs = [popen(shlex.split(c), cwd, background=False) for c in commands]
    try:
        collect_in_wait()
        return all(p is not None and p.wait() == 0 for p in procs)
    finally:
        for p in procs:
            if p is not None and p.poll() is None:
                kill(p)


def last_build() -> str | None:
    """How this process's last kernel batch was built: ``plain``, ``header``, ``header, in
    parts``, ``raced: with the header``, ``raced: without the header`` or ``raced: the header, in
    parts`` (tests, logs)."""
    return _state.get("last")


def _race(plain: str, with_cmd: str, job: Any, cwd: Path, keep_with: Callable[[], None],
          parts: Sequence[str] = ()) -> bool:
    """The batch built without the header and, once the header is built, with it: the first
    build to succeed is kept, the other killed — unless the plain build has run for less than
    :data:`SWITCH_TO_PARTS` of the header's build when that ends and the batch comes in
    ``parts`` (commands): it is killed then, and the parts built with the header (True; the
    plain build again if a part fails). Raises when neither builds."""
    started = time.perf_counter()
    mine = popen(shlex.split(plain), cwd, background=False)
    assert mine is not None  # a foreground run always starts
    other: subprocess.Popen[bytes] | None = None
    tried = False  # the build with the header: started once at most
    try:
        while True:
            code = mine.poll()
            if code == 0:
                _state["last"] = "raced: without the header"
                return False
            if not tried and job.done.is_set():
                tried = True
                ran = time.perf_counter() - started
                if (job.ok and parts and code is None and job.seconds is not None
                        and ran < SWITCH_TO_PARTS * job.seconds):
                    kill(mine)
                    if _build_parts(list(parts), cwd):
                        _state["last"] = "raced: the header, in parts"
                        return True
                    mine = popen(shlex.split(plain), cwd, background=False)
                    assert mine is not None
                    continue
                other = popen(shlex.split(with_cmd), cwd, background=False) if job.ok else None
            if other is not None and other.poll() is not None:
                if other.returncode == 0:
                    _state["last"] = "raced: with the header"
                    keep_with()
                    return False
                other = None
            if code is not None and tried and other is None:
                raise subprocess.CalledProcessError(code, plain)
            time.sleep(0.01)
    finally:
        for p in (mine, other):
            if p is not None and p.poll() is None:
                kill(p)
            elif p is not None:
                reap(p)
