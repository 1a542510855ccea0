"""The content-addressed artifact store (import name ``aotc.cache``). Never imports torch."""

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
from aotc.cache.store import Entry, Store

__all__ = [
    "AotcError", "CacheMiss", "CorruptedCacheError", "CorruptedIndexError", "StoreError", "StoreLockedError",
    "StoreNotFoundError", "StoreReadOnlyError", "Entry", "Store",
]

from aotc.cache.maintenance import (  # noqa: E402 - after the names the submodules import from this package
    EntryInfo,
    GcPlan,
    Problem,
    StoreScan,
    VerifyReport,
    delete_entries,
    parse_size,
    plan_gc,
    scan,
    verify,
    verify_at,
)

__all__ += [
    "EntryInfo", "GcPlan", "Problem", "StoreScan", "VerifyReport", "delete_entries", "parse_size",
    "plan_gc", "scan", "verify", "verify_at",
]
