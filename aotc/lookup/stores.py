"""Opening the store a caller means: a ``Store``, a path, the manifest's ``store`` field, or the
default (``AOTC_STORE``, else ``$XDG_CACHE_HOME/aotc``: :class:`aotc.settings.Settings`). Kept
apart from the compiler so that a warm start imports nothing of the compile journey."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from aotc.cache import Store
from aotc.manifest import Manifest, load_manifest
from aotc.settings import Settings, is_remote_url


def open_store(store: Any, manifest: Manifest | None = None, create: bool = False,
               settings: Settings | None = None) -> Store:
    """A ``Store`` from a Store, a path, the manifest's ``store`` field, or the default (the
    entry point's ``settings``: ``AOTC_STORE``, else ``$XDG_CACHE_HOME/aotc``; without settings
    ``~/.cache/aotc``).
    ``create``: make it when missing (journeys that write); otherwise a missing store is a
    ``StoreNotFoundError`` naming the path. A store opened here is bounded by the settings'
    ``AOTC_MAX_SIZE`` (a ``Store`` passed in keeps its own bound)."""
    if isinstance(store, Store):
        return store
    settings = settings or Settings()
    if store is not None:
        return Store(store, create=create, max_size=settings.max_size)
    if manifest is not None and manifest.store is not None:
        return Store(manifest.store, create=create, max_size=settings.max_size)
    return Store(settings.default_store_path(), create=create, max_size=settings.max_size)


def split_store(store: Any, remote: Any, settings: Settings) -> tuple[Any, Any]:
    """(local store argument, a ``Remote`` or None) from what a caller passed: ``store`` may be
    a remote URL (then the local store is the default one; so is an ``AOTC_STORE`` that is
    one), ``remote`` a URL or a remote; with neither, the settings' ``AOTC_REMOTE``."""
    from aotc.fleet.remote import open_remote

    if store is None and settings.store_is_remote:
        store = settings.store
    if is_remote_url(store):
        store, remote = None, remote or store
    if remote is None or isinstance(remote, str):
        remote = open_remote(remote, settings)
    return store, remote


def as_manifest(manifest: Manifest | str | Path) -> Manifest:
    """A ``Manifest`` from a Manifest or a path to one (validated: ``ManifestError`` if bad)."""
    return manifest if isinstance(manifest, Manifest) else load_manifest(manifest)
