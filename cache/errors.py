"""Errors raised by the store. The root of aotc's error hierarchy lives here so that
``aotc.cache`` stays free of every other aotc module (and of torch); ``aotc.errors`` re-exports it."""

from __future__ import annotations


class AotcError(Exception):
    """Base of every error aotc raises on purpose. ``exit_code`` is what the CLI exits with."""

    exit_code: int = 1


class StoreError(AotcError):
    """The store cannot be used as asked (bad path, bad argument)."""


class CacheMiss(StoreError):
    """No entry under the key asked for."""

    def __init__(self, key: str, hint: str = "", label: str = "key") -> None:
        self.key = key
        msg = f"no store entry for {label} {key[:16]}…"
        super().__init__(msg + (f"; {hint}" if hint else ""))


class CorruptedCacheError(StoreError):
    """A blob's bytes do not hash to its name, or an entry points at a blob that is missing."""

    def __init__(self, key: str, role: str, digest: str, problem: str) -> None:
        self.key, self.role, self.digest, self.problem = key, role, digest, problem
        super().__init__(
            f"store entry {key[:16]}… blob {role!r} ({digest[:16]}…) is corrupt: {problem}; "
            "the entry was marked bad; run `aotc verify --repair` to evict it"
        )


class CorruptedIndexError(CorruptedCacheError):
    """The store's sqlite index itself is damaged (truncated, overwritten): no entry can be trusted."""

    def __init__(self, path: str, problem: str) -> None:
        self.key, self.role, self.digest, self.problem = "", "index", "", problem
        self.path = path
        StoreError.__init__(
            self,
            f"store index {path} is corrupt ({problem}); run `aotc verify --repair` to set it "
            "aside and start an empty index (its entries are lost: recompile them)",
        )


class StoreLockedError(StoreError):
    """The sqlite index stayed locked by another process beyond the busy timeout."""

    def __init__(self, path: str, seconds: float) -> None:
        super().__init__(
            f"store index {path} stayed locked for {seconds:.0f}s by another process; "
            "retry, or find the process holding it (`fuser {path}`)"
        )


class StoreNotFoundError(StoreError):
    """A command that only reads was pointed at a directory that holds no store."""

    def __init__(self, root: str) -> None:
        self.root = root
        super().__init__(
            f"no aotc store at {root} (no store-v1/index.sqlite there); check --store / "
            "AOTC_STORE, or create it by compiling (`aotc compile`), importing or pulling into it"
        )


class StoreReadOnlyError(StoreError):
    """A write was asked of a store opened read-only (a read-only volume)."""

    def __init__(self, root: str, what: str) -> None:
        super().__init__(f"store {root} is read-only: cannot {what}; use a writable store "
                         "(--store DIR / AOTC_STORE) for that")
