"""The one ``AotcError`` hierarchy. Store errors come from ``aotc.cache.errors`` (torch-free);
everything the compile and load journeys raise is defined here. Every message names the file /
field / key concerned and what to do."""

from __future__ import annotations

from aotc.cache.errors import (
    AotcError,
    CacheMiss,
    CorruptedCacheError,
    CorruptedIndexError,
    StoreError,
    StoreLockedError,
    StoreNotFoundError,
    StoreReadOnlyError,
)

__all__ = [
    "AotcError", "CacheMiss", "CorruptedCacheError", "CorruptedIndexError", "StoreError",
    "StoreLockedError", "StoreNotFoundError", "StoreReadOnlyError",
    "SettingsError", "ManifestError", "ModelBuildError", "CaptureError", "SplitError", "CompileError",
    "NumericMismatchError", "LoadError", "InputError", "RunError", "BackendError", "VllmError",
    "RemoteError", "MissingObject", "OversizedObject", "DamagedRemoteEntry", "TrustError", "UnsafeStoreError",
    "BundleError",
    "PrecompileError", "one_line",
]


class SettingsError(AotcError):
    """An ``AOTC_*`` environment variable holds a value aotc cannot use; names the variable."""

    exit_code = 2


class ManifestError(AotcError):
    """The manifest file is malformed or invalid. Message: ``file: field.path: what was expected``."""

    exit_code = 2

    def __init__(self, file: str, field: str, problem: str) -> None:
        self.file, self.field, self.problem = file, field, problem
        where = f"{file}: {field}: " if field else f"{file}: "
        super().__init__(where + problem)


class ModelBuildError(AotcError):
    """The model named by the manifest could not be imported or built."""

    exit_code = 2


class CaptureError(AotcError):
    """Dynamo could not capture the model in one graph (graph break, unsupported op)."""

    exit_code = 2


class SplitError(AotcError):
    """The graph could not be split at the splitting ops."""

    exit_code = 2


class CompileError(AotcError):
    """Inductor failed to compile a piece."""


class NumericMismatchError(AotcError):
    """The compiled program disagrees with eager beyond the manifest's tolerance."""


class LoadError(AotcError):
    """A stored program cannot be loaded into this process (weights mismatch, bad artifact)."""


class InputError(AotcError):
    """Inputs given to a Runner do not match the recorded input spec, or a command-line argument
    (a key, a size) is not valid."""

    exit_code = 2


class RunError(AotcError, RuntimeError):
    """A compiled piece failed while running (a kernel's own check); names the piece and size.
    A ``RuntimeError`` too, as the same failure is under ``torch.compile(backend="inductor")``."""


class BackendError(AotcError):
    """The ``torch.compile`` backend cannot key, compile or load the graph Dynamo handed it (a
    constant with no stable spelling, a bad ``aotc.backend(...)`` argument)."""


class PrecompileError(AotcError):
    """A function could not be precompiled (a graph break, a graph aotc cannot serve, Dynamo's
    output not savable) or its stored precompiled form cannot be used here."""


class VllmError(AotcError):
    """A manifest's ``vllm`` model could not be compiled with the vLLM engine (vLLM missing, the
    engine failed to start)."""


class RemoteError(AotcError):
    """A remote store cannot be reached or used, or holds something damaged (named, with the fix)."""

    exit_code = 1


class MissingObject(RemoteError):
    """A remote object that should be there is not."""


class OversizedObject(RemoteError):
    """A remote object is larger than anything aotc writes under that name."""


class DamagedRemoteEntry(RemoteError):
    """A remote entry's record does not parse or names another key."""


class TrustError(AotcError):
    """An entry is not signed by a trusted key under the trust policy, or a key is unusable."""

    exit_code = 1


class UnsafeStoreError(TrustError):
    """A store someone other than this user (or root) could write, asked to load code without a
    trust policy that requires signatures (ssh's ``StrictModes``); names the path, its mode and
    the fix (:func:`aotc.fleet.trust.enforce_store`)."""


class BundleError(AotcError):
    """A bundle file that cannot be exported or imported as it is (named, with the reason)."""

    exit_code = 1


def one_line(error: BaseException, limit: int = 400) -> str:
    """``Type: message`` of ``error`` on one line (whitespace folded), cut at ``limit``: how a
    warning or a remembered reason names an error."""
    return " ".join(f"{type(error).__name__}: {error}".split())[:limit]
