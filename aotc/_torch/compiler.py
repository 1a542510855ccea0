"""The compiler seam, in the shape of vLLM's ``CompilerInterface``: :class:`PieceCompiler`
compiles (piece, size) tasks into :class:`CompiledPiece` results; :func:`load` turns stored
artifacts back into callables. Every Inductor detail stays below it — the kernel batch
(:mod:`kernel_batch`), the kernel pool (:mod:`kernel_pool`), the ISA probes, the precompiled
header — and so does the task-result format (:mod:`aotc._torch.task_result`).

The callers above (``aotc.compile.workers``) schedule tasks, hold locks, and nothing else. The
compile side is imported when first used, so a warm start that only loads imports none of it.
Tested with torch 2.11 and 2.13.
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from aotc._torch.task_result import CompiledPiece

if TYPE_CHECKING:
    from aotc._torch.inductor_compile import PendingPiece

__all__ = ["PieceCompiler", "as_fresh", "load"]

class PieceCompiler:
    """``compile(piece, size)`` for one process: tasks are started one by one and finished in
    batches, the C++ kernels of a batch built by one compiler run (each run loads the
    precompiled header and links: a fixed cost paid once a batch). ``options``: Inductor config patches;
    ``pool``: the compile's kernel pool directory (libraries built once per job)."""

    def __init__(self, options: dict[str, Any], pool: Path) -> None:
        from aotc._torch import kernel_batch

        self.options, self.pool = dict(options), pool
        self._batch = kernel_batch.KernelBatch()
        self._held: list[tuple[Any, str, PendingPiece]] = []

    def __len__(self) -> int:
        """Tasks started and not finished."""
        return len(self._held)

    def start(self, tag: Any, gm: Any, example_inputs: Sequence[Any], size: int | None, scratch: Path,
              real_inputs: dict[int, Any], label: str) -> None:
        """Compile one piece for ``size`` (None: dynamic) up to its kernels, into
        ``scratch / "result"``; :meth:`finish` completes it. ``tag`` comes back with the result."""
        from aotc._torch import inductor_compile

        pending = inductor_compile.start_piece(gm, list(example_inputs), size, scratch / "result",
                                               self.options, scratch, real_inputs, label, self.pool,
                                               self._batch)
        self._held.append((tag, label, pending))

    def finish(self) -> Iterator[tuple[Any, CompiledPiece]]:
        """Build the held kernels in one run, then finish each task in order: ``(tag, piece)``.
        A task whose finishing raises is dropped and the error propagates (:meth:`abandon`
        drops the rest)."""
        from aotc._torch import inductor_compile

        t = time.perf_counter()
        inductor_compile.build_kernels(self._batch, ", ".join(label for _, label, _ in self._held))
        share = (time.perf_counter() - t) / max(len(self._held), 1)
        while self._held:
            tag, _, pending = self._held.pop(0)
            try:
                c = inductor_compile.finish_piece(pending, share)
            finally:
                pending.discard()
            yield tag, c

    def abandon(self) -> list[Any]:
        """Drop every held task (a failure elsewhere); returns their tags."""
        tags = [tag for tag, _, _ in self._held]
        for _, _, pending in self._held:
            pending.discard()
        self._held.clear()
        return tags


def load(artifacts: Sequence[Path], kernel_root: Path, options: dict[str, Any] | None) -> list[Any]:
    """``load(record) -> callable`` for artifacts without a fast-path record: each through
    Inductor's own loader, over the kernel libraries restored under ``kernel_root``. (A piece
    with one loads through :mod:`aotc._torch.wrapper`, which never imports Inductor.)"""
    from aotc._torch import inductor_load

    return inductor_load.load_pieces(list(artifacts), kernel_root, options=options)


def as_fresh(c: CompiledPiece, compiled: CompiledPiece) -> CompiledPiece:
    """A result read back after :func:`save_result`, with the figures of the compile that made it."""
    return replace(c, resumed=False, seconds=compiled.seconds, phases=compiled.phases,
                   kernels=compiled.kernels)
