"""The ``Program`` record: everything the loader needs besides the artifact bytes, as JSON.

stitching graph + ArgSpec + piece table + per-piece artifact table (dynamic and each static size)
+ sizes + provenance (source files, factors summary, numeric check figures). Stored as the blob
``program`` of an entry; the compiled artifacts and kernel files are the entry's other blobs.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from typing import Any

from aotc.errors import LoadError
from aotc.records.key import FORMAT_VERSION

PROGRAM_ROLE = "program"
KERNEL_PREFIX = "kernel/"


def artifact_role(uid: str, size: int | None) -> str:
    """The blob role of piece ``uid``'s Inductor artifact for ``size`` tokens (None: dynamic)."""
    return f"artifact/{uid}/{size or 'dynamic'}"


def wrapper_role(uid: str, size: int | None) -> str:
    """The blob role of that artifact's fast-path record (``aotc._torch.wrapper``)."""
    return f"wrapper/{uid}/{size or 'dynamic'}"


def kernel_role(rel: str) -> str:
    """The blob role of a kernel file at ``rel`` under the kernel root."""
    return KERNEL_PREFIX + rel


def kernel_roles(kernel_files: Any) -> dict[str, str]:
    """Kernel file (relative path) -> its blob role, sorted by path."""
    return {rel: kernel_role(rel) for rel in sorted(kernel_files)}


@dataclass(frozen=True)
class Slot:
    """One placeholder of the captured graph: ``param``/``buffer`` (``fqn``), ``input`` (``index``)
    or ``symbol`` (the size of dim ``dim`` of input ``index``)."""

    kind: str
    fqn: str | None = None
    index: int | None = None
    dim: int | None = None
    shape: list[int] | None = None  # param/buffer: the shape the program was compiled for
    dtype: str | None = None  # param/buffer: its dtype ("float32", …)


@dataclass(frozen=True)
class ArtifactRecord:
    """One Inductor artifact: compiled piece ``uid`` for ``size`` tokens (None = dynamic)."""

    uid: str
    size: int | None
    role: str  # blob role of the saved artifact
    wrapper_role: str | None = None  # blob role of its fast-path record (aotc._torch.wrapper), if any


@dataclass(frozen=True)
class PieceRecord:
    """One piece of the split graph, in stitching order."""

    name: str
    kind: str  # "compiled" | "splitting"
    uid: str | None = None  # compiled: unique-piece id (shared by identical pieces)
    graph: dict[str, Any] | None = None  # splitting: the encoded graph, run eagerly
    op: str | None = None  # splitting: the op name, for display
    returns_tuple: bool = True  # compiled: the piece graph returns a tuple (else one value;
    # torch < 2.12's split_module has no tuple_return and single outputs come back bare)
    # compiled: per input, the dense layout it was compiled for (dims from outermost to
    # innermost) when the input comes from another piece or is a graph input of dynamic shape;
    # None where the caller's own layout stands (weights, non-dense views). See
    # aotc.runtime.stitched.PieceCall.
    layouts: list[list[int] | None] | None = None


@dataclass(frozen=True)
class Program:
    """A compiled, stitched model. ``to_json``/``from_json`` round-trip exactly."""

    name: str
    device: str
    dtype: str
    slots: tuple[Slot, ...]
    inputs: tuple[dict[str, Any], ...]  # the manifest's input specs (name, dtype, shape, …)
    stitch: dict[str, Any]
    pieces: tuple[PieceRecord, ...]
    artifacts: tuple[ArtifactRecord, ...]
    kernel_roles: dict[str, str]  # kernel file path (relative to the kernel root) -> blob role
    compile_sizes: tuple[int, ...]
    capture_sizes: tuple[int, ...]
    max_tokens: int
    dynamic_mode: str  # "unbacked" | "backed" | "static"
    min_dynamic_tokens: int  # sizes below this need a static artifact (backed graphs: 2)
    source_files: dict[str, str]  # relative path -> sha256
    numerics: dict[str, Any] = field(default_factory=dict)
    output: Any = None  # the manifest's model.output: a field / index, a list of them, or None
    # compiled with autograd (a graph traced with grad on and inputs that require it): pieces
    # return outputs with a grad_fn and the stitch runs under the caller's grad mode
    training: bool = False
    format: int = FORMAT_VERSION

    @property
    def unique_pieces(self) -> list[str]:
        seen: list[str] = []
        for p in self.pieces:
            if p.uid and p.uid not in seen:
                seen.append(p.uid)
        return seen

    def to_json(self) -> bytes:
        """Canonical JSON bytes (sorted keys)."""
        return json.dumps(asdict(self), sort_keys=True, separators=(",", ":")).encode()

    @classmethod
    def from_json(cls, data: bytes) -> Program:
        """Parse a stored program; a wrong format version or shape is a ``LoadError``."""
        try:
            d = json.loads(data)
            if d.get("format") != FORMAT_VERSION:
                raise LoadError(
                    f"stored program has format {d.get('format')}, this aotc reads {FORMAT_VERSION}; "
                    "recompile with `aotc compile --force`"
                )
            return cls(
                name=d["name"], device=d["device"], dtype=d["dtype"],
                slots=tuple(Slot(**s) for s in d["slots"]),
                inputs=tuple(d["inputs"]), stitch=d["stitch"],
                pieces=tuple(PieceRecord(**p) for p in d["pieces"]),
                artifacts=tuple(ArtifactRecord(**a) for a in d["artifacts"]),
                kernel_roles=dict(d["kernel_roles"]), compile_sizes=tuple(d["compile_sizes"]),
                capture_sizes=tuple(d["capture_sizes"]), max_tokens=int(d["max_tokens"]),
                dynamic_mode=d["dynamic_mode"], min_dynamic_tokens=int(d["min_dynamic_tokens"]),
                source_files=dict(d["source_files"]), numerics=dict(d.get("numerics", {})),
                output=d.get("output"), training=bool(d.get("training", False)), format=d["format"],
            )
        except LoadError:
            raise
        except (ValueError, KeyError, TypeError) as e:
            raise LoadError(f"stored program is malformed ({type(e).__name__}: {e}); "
                            "recompile with `aotc compile --force`") from e
