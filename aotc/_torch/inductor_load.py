"""Loading saved Inductor artifacts (``CompiledArtifact.load``) over the kernel libraries shipped
with them, in a scoped Inductor cache dir: the load side of the fence around ``torch._inductor``.
The warm start uses it only for pieces that do not qualify for :mod:`aotc._torch.wrapper`.
Loading through here still runs ``g++ --version`` (part of each kernel's key) and imports
Inductor (seconds). Written for torch 2.11–2.13, API differences feature-checked; tested on 2.13.0
(CPU).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import torch

from aotc._torch.inductor_facts import _config_patch
from aotc._torch.kernel_checks import guarded_kernel_sources
from aotc._torch.scoped_env import process_scope, scoped_env
from aotc.counters import COUNTERS as _ours
from aotc.errors import LoadError

__all__ = ["in_process_isa_probes", "inductor_cache_dir", "kernel_files", "load_piece", "load_pieces"]

# Files in a compile-time cache dir worth shipping: binaries Inductor checks for by path.
_KERNEL_SUFFIXES = (".so", ".o", ".cubin", ".hsaco", ".ptx", ".json", ".llir", ".ttir", ".ttgir")
_SKIP_DIRS = {"locks", "fxgraph", "aotautograd", "pgo", "precompiles"}


def _clear_code_caches() -> None:
    try:
        from torch._inductor.utils import clear_caches
    except ImportError:  # pragma: no cover - older torch
        return
    clear_caches()


@contextlib.contextmanager
def inductor_cache_dir(path: Path | str) -> Iterator[Path]:
    """Point Inductor's (and Triton's) on-disk caches at ``path`` for the block; restore after.

    Sets ``TORCHINDUCTOR_CACHE_DIR`` and ``TRITON_CACHE_DIR`` (= ``path/triton``) and clears
    Inductor's in-memory code caches on entry and exit, so what is compiled or loaded in the
    block is read from / written to ``path`` only. The one place aotc changes torch's env.
    """
    path = Path(path).resolve()
    path.mkdir(parents=True, exist_ok=True)
    with scoped_env(TORCHINDUCTOR_CACHE_DIR=str(path), TRITON_CACHE_DIR=str(path / "triton")):
        _clear_code_caches()
        try:
            yield path
        finally:
            _clear_code_caches()


def kernel_files(root: Path) -> list[str]:
    """The shippable kernel files under a compile's Inductor cache dir (sorted relative paths)."""
    out = []
    for p in root.rglob("*"):
        rel = p.relative_to(root)
        if p.is_file() and rel.parts[0] not in _SKIP_DIRS and p.name.endswith(_KERNEL_SUFFIXES):
            out.append(rel.as_posix())
    return sorted(out)


def load_piece(
    artifact_file: Path, kernel_root: Path, *, options: dict[str, Any] | None = None
) -> Callable[..., list[torch.Tensor]]:
    """Load a saved piece; the returned callable always returns a list of outputs.

    ``options``: the same Inductor config patches the piece was compiled with (some, like
    ``cpp.simdlen``, enter each kernel's build key; a mismatch makes Inductor rebuild it).

    ``kernel_root`` must hold the piece's kernel files at their recorded relative paths; it is
    used as the Inductor cache dir during the load (Inductor writes its regenerated wrapper
    sources there too, so it must be writable and should outlive the returned callable).
    """
    return load_pieces([artifact_file], kernel_root, options=options)[0]


@contextlib.contextmanager
def in_process_isa_probes() -> Iterator[None]:
    """While loading or compiling: answer Inductor's ISA-extension probes (AVX512-BF16, VNNI,
    AMX …) by dlopen-ing the probe library in this process instead of in a child Python per
    probe (a child interpreter each). The libraries were built for this key's march/ISA and are only
    loaded, never called. Torch 2.11–2.13: ``VecISA._probe_load(self, path) -> bool``."""
    try:
        from torch._inductor.cpu_vec_isa import VecISA
    except ImportError:  # pragma: no cover - other torch layouts: keep torch's own probe
        yield
        return
    original = getattr(VecISA, "_probe_load", None)
    if original is None:
        yield
        return

    def probe(self: Any, output_path: str) -> bool:
        import ctypes

        try:
            ctypes.CDLL(output_path)
        except OSError:
            return False
        return True

    with process_scope():  # the class is the process's: one thread's block at a time
        VecISA._probe_load = probe  # type: ignore[method-assign]  # patched for the block, put back after it
        try:
            yield
        finally:
            VecISA._probe_load = original  # type: ignore[method-assign]  # patched for the block, put back after it


# where a load's kernel builds would find the precompiled header: nowhere (see _no_header_builds)
_NO_HEADER = "/nonexistent/aotc-loads-build-nothing.h"


@contextlib.contextmanager
def _no_header_builds() -> Iterator[None]:
    """While loading: Inductor's ``codecache._precompile_header`` (torch 2.11–2.13) preprocesses
    and hashes its ~150 MB C++ header — building it when missing — before it looks for the
    kernel, which is shipped and found by name (the header's flag is in the name, not its path).
    Answer it with a path that does not exist instead: nothing is preprocessed, and a kernel that
    would be built after all fails loudly instead of running the compiler at load."""
    try:
        from torch._inductor import codecache
    except ImportError:  # pragma: no cover
        yield
        return
    original = getattr(codecache, "_precompile_header", None)
    if original is None:
        yield
        return
    setattr(codecache, "_precompile_header", lambda *args, **kwargs: _NO_HEADER)  # noqa: B010 - a private name torch may not have: set by name
    try:
        yield
    finally:
        setattr(codecache, "_precompile_header", original)  # noqa: B010 - a private name torch may not have: set by name


def load_pieces(
    artifact_files: Sequence[Path], kernel_root: Path, *, options: dict[str, Any] | None = None
) -> list[Callable[..., list[torch.Tensor]]]:
    """Load several saved pieces sharing one kernel root, in one Inductor cache-dir scope (the
    in-memory code caches are cleared once, not per artifact); see :func:`load_piece`."""
    kernel_root = Path(kernel_root)
    out = []
    # The vector ISA was settled at compile time and is in the key (toolchain.vec_isa, march):
    # the fixed config trusts the CPU flags instead of Inductor re-probing each ISA by compiling
    # and dlopen-ing a test library in a child Python (a subprocess per ISA).
    with inductor_cache_dir(kernel_root), _config_patch(dict(options or {})), \
            in_process_isa_probes(), _no_header_builds(), guarded_kernel_sources():
        for artifact_file in map(Path, artifact_files):
            if not artifact_file.is_file():
                raise LoadError(f"{artifact_file}: compiled artifact missing")
            try:
                art = torch._inductor.CompiledArtifact.load(path=str(artifact_file), format="binary")
            except Exception as e:  # noqa: BLE001 - code we do not own fails in many ways; each is turned into one of ours
                raise LoadError(f"{artifact_file}: cannot load compiled artifact ({type(e).__name__}: "
                                f"{e}); it was built by another torch build (torch_key) or is "
                                "damaged — recompile it") from e
            _ours.loads += 1
            out.append(_normalized(art))
    return out


def _normalized(art: Any) -> Callable[..., list[torch.Tensor]]:
    def run(*args: Any) -> list[torch.Tensor]:
        res = art(*args)
        return list(res) if isinstance(res, (list, tuple)) else [res]

    run.artifact = art  # type: ignore[attr-defined]  # the loaded artifact, kept on the function for callers that want it
    return run
