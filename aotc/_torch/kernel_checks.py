"""A failed check inside a compiled C++ kernel reaches Python as an exception instead of
aborting the process: part of the fence around ``torch._inductor``. Written for the kernel
sources of torch 2.11–2.13, tested on 2.13.0 (CPU).

Inductor guards every indirect index it cannot prove in range with ``TORCH_CHECK(cond, "index
out of bounds: …")``, which throws a C++ exception. Thrown inside an OpenMP parallel region (the
exception may not leave it) that is ``std::terminate``: the whole process dies with SIGABRT. The
kernel's Python binding would have turned the exception into a ``RuntimeError`` had it been
thrown outside the region, and Inductor only parallelizes some kernels (every one with
``cpp.dynamic_threads``, which vLLM's CPU workers compile with) — so a token id outside the
vocabulary raises under ``torch.compile(backend="inductor")`` and killed a server under aotc.

:func:`guard_checks` rewrites each such check that sits in a loop into: note the first failure
in a variable of the kernel call (shared by the region's threads), skip the rest of this loop
iteration (the bad index is never dereferenced), and at the end of the kernel, outside every
region, throw the noted message. The rewrite keeps every line where it was. A check it cannot
place (outside a loop, inside a lambda, a message that is not one string literal, a kernel that
returns early) is left as Inductor wrote it. The rewritten source is the source Inductor keys,
builds and loads, at compile time and at load time alike (:func:`guarded_kernel_sources`).
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Iterator
from typing import Any

__all__ = ["guard_checks", "guarded_kernel_sources"]

_KERNEL = re.compile(r'extern\s+"C"\s+void\s+kernel\s*\(')
_CHECK = "TORCH_CHECK"
_LITERAL = re.compile(r'^"(?:[^"\\\n]|\\.)*"$')
_LOOP_HEAD = re.compile(r"^(?:for|while)\s*\(")
_LAMBDA_HEAD = re.compile(r"\[[^\[\]]*\]\s*(?:\([^()]*\))?\s*(?:mutable\s*)?(?:->\s*[\w:<>,\s*&]+)?$")
# a lambda's parameters or capture, its ``mutable`` and return type, right before its ``{``
_LAMBDA_TAIL = re.compile(r"[\])]\s*(?:mutable\s*)?(?:->\s*[\w:<>,\s*&]+)?\s*$")
_FLAG = "aotc_check_failure"
_DECLARE = f" std::atomic<const char*> {_FLAG}{{nullptr}};"
_RAISE = f" if (const char* aotc_what = {_FLAG}.load()) throw std::runtime_error(aotc_what);"


def _skip(text: str, i: int) -> int:
    """The index after a string/char literal, comment or preprocessor line starting at ``i``
    (``i`` itself when none starts there)."""
    c = text[i]
    if c in "\"'":
        j = i + 1
        while j < len(text) and text[j] != c:
            j += 2 if text[j] == "\\" else 1
        return j + 1
    if text.startswith("//", i):
        end = text.find("\n", i)
        return len(text) if end < 0 else end
    if text.startswith("/*", i):
        end = text.find("*/", i + 2)
        return len(text) if end < 0 else end + 2
    if c == "#" and text[text.rfind("\n", 0, i) + 1:i].strip() == "":
        j = i
        while True:
            end = text.find("\n", j)
            if end < 0:
                return len(text)
            if text[end - 1] != "\\":
                return end
            j = end + 1
    return i


def _match(text: str, i: int, open_: str, close: str) -> int:
    """Index of the bracket closing the one at ``i`` (literals and comments skipped), or -1."""
    depth = 0
    j = i
    while j < len(text):
        k = _skip(text, j)
        if k != j:
            j = k
            continue
        if text[j] == open_:
            depth += 1
        elif text[j] == close:
            depth -= 1
            if depth == 0:
                return j
        j += 1
    return -1


def _split_args(inner: str) -> list[str]:
    """Top-level comma-separated arguments of a call's inside."""
    args, depth, start, j = [], 0, 0, 0
    while j < len(inner):
        k = _skip(inner, j)
        if k != j:
            j = k
            continue
        c = inner[j]
        if c in "([{<":
            depth += c != "<"
        elif c in ")]}":
            depth -= 1
        elif c == "," and depth == 0:
            args.append(inner[start:j].strip())
            start = j + 1
        j += 1
    args.append(inner[start:].strip())
    return args


def _head(text: str, start: int, brace: int) -> str:
    """What precedes a ``{`` since the last statement boundary, preprocessor lines dropped."""
    lines = [ln for ln in text[start:brace].splitlines() if not ln.lstrip().startswith("#")]
    return " ".join(" ".join(lines).split())


def guard_checks(source: str) -> str:
    """``source`` with each ``TORCH_CHECK`` of its kernel that sits in a loop made safe for a
    parallel region (module doc); unchanged when there is none or the kernel is not shaped as
    expected."""
    found = _KERNEL.search(source)
    if found is None or _CHECK not in source:
        return source
    close = _match(source, found.end() - 1, "(", ")")
    body = source.find("{", close) if close > 0 else -1
    end = _match(source, body, "{", "}") if body > 0 else -1
    if end < 0 or source[close + 1:body].strip():
        return source
    edits: list[tuple[int, int, str]] = []
    blocks: list[str] = []  # "loop" | "lambda" | "block", innermost last
    paren = 0
    boundary = body + 1
    i = body + 1
    while i < end:
        k = _skip(source, i)
        if k != i:
            i = k
            continue
        c = source[i]
        if c == "(":
            paren += 1
        elif c == ")":
            paren -= 1
        elif c == "{" and paren == 0:
            head = _head(source, boundary, i)
            blocks.append("loop" if _LOOP_HEAD.match(head) or head == "do"
                          else "lambda" if _LAMBDA_HEAD.search(head) else "block")
            boundary = i + 1
        elif c == "{":  # in a call's arguments: a lambda's body, or a braced initializer
            blocks.append("lambda" if _LAMBDA_TAIL.search(source, max(body, i - 300), i) else "block")
        elif c == "}":
            if not blocks:
                return source
            blocks.pop()
            if paren == 0:
                boundary = i + 1
        elif c == ";" and paren == 0:
            boundary = i + 1
        elif (c.isalpha() or c == "_") and (i == 0 or not (source[i - 1].isalnum() or source[i - 1] == "_")):
            j = i
            while j < end and (source[j].isalnum() or source[j] == "_"):
                j += 1
            word = source[i:j]
            in_lambda = "lambda" in blocks
            if word == "return" and not in_lambda:
                return source  # an early return would skip the throw at the end
            if word == _CHECK:
                opened = j + len(source[j:]) - len(source[j:].lstrip())
                shut = _match(source, opened, "(", ")") if source[opened:opened + 1] == "(" else -1
                semi = shut + 1 + len(source[shut + 1:]) - len(source[shut + 1:].lstrip()) if shut > 0 else -1
                if shut > 0 and source[semi:semi + 1] == ";":
                    args = _split_args(source[opened + 1:shut])
                    inner = next((b for b in reversed(blocks) if b != "block"), None)
                    if inner == "loop" and len(args) == 2 and _LITERAL.match(args[1]) \
                            and "\n" not in source[i:semi]:
                        edits.append((i, semi + 1,
                                      f"if (C10_UNLIKELY(!({args[0]}))) {{ const char* aotc_none = "
                                      f"nullptr; {_FLAG}.compare_exchange_strong(aotc_none, "
                                      f"{args[1]}); continue; }}"))
                    i = semi + 1
                    boundary = i
                    continue
            i = j
            continue
        i += 1
    if not edits:
        return source
    out = [source[:body + 1], _DECLARE]
    at = body + 1
    for start, stop, text in edits:
        out += [source[at:start], text]
        at = stop
    out += [source[at:end], _RAISE, source[end:]]
    return "".join(out)


@contextlib.contextmanager
def guarded_kernel_sources() -> Iterator[None]:
    """Within the block, every C++ kernel Inductor builds or loads through
    ``AsyncCompile.cpp_pybinding`` is :func:`guard_checks`' rewrite of its source (the same
    rewrite at compile and at load, so a load finds the library the compile built)."""
    try:
        from torch._inductor.async_compile import AsyncCompile
    except ImportError:  # pragma: no cover - another torch layout: Inductor's own kernels
        yield
        return
    original = AsyncCompile.cpp_pybinding

    def cpp_pybinding(self: Any, argtypes: Any, source_code: str, *rest: Any, **kw: Any) -> Any:
        return original(self, argtypes, guard_checks(source_code), *rest, **kw)

    AsyncCompile.cpp_pybinding = cpp_pybinding  # type: ignore[method-assign]  # patched for the block, put back after it
    try:
        yield
    finally:
        AsyncCompile.cpp_pybinding = original  # type: ignore[method-assign]  # patched for the block, put back after it
