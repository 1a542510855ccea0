"""Shared CLI plumbing: the lazily built Store, error mapping, JSON printing."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import click

from aotc.cache.errors import AotcError
from aotc.cache.store import Store
from aotc.settings import Settings, is_remote_url


class AppContext:
    """What the group callback resolves once and every command receives: the local store's
    location and, on first use, the ``Store`` itself; and the remote store, if any.

    ``--store s3://bucket/prefix`` (or such an ``AOTC_STORE``) makes the remote *the* store:
    commands that list or verify act on it, ``run`` pulls through it and ``compile`` pushes to
    it, with the default local store as the cache in front. ``--remote`` / ``AOTC_REMOTE`` only
    names the remote that ``push``, ``pull`` and ``run`` use."""

    def __init__(self, store_path: str | None, remote_url: str | None = None,
                 endpoint_url: str | None = None, settings: Settings | None = None,
                 max_size_source: str | None = None) -> None:
        self.settings = settings = settings or Settings()
        # where the store's bound came from: "--max-size", "AOTC_MAX_SIZE" or None (no bound)
        self.max_size_source = max_size_source if settings.max_size is not None else None
        self.store_is_remote = is_remote_url(store_path or settings.store)
        if self.store_is_remote:  # the local cache: AOTC_STORE if that is a directory
            self.remote_url: str | None = store_path or settings.store
            store_path = None
        else:
            self.remote_url = remote_url or settings.remote
        self.endpoint_url = endpoint_url or settings.s3_endpoint
        self.store_path = Path(store_path).expanduser() if store_path else settings.default_store_path()
        self._store: Store | None = None
        self._remote: Any = None

    @property
    def store(self) -> Store:
        """The local store; it must exist (commands that only read never create one)."""
        if self._store is None:
            self._store = Store(self.store_path, create=False, max_size=self.settings.max_size)
        return self._store

    @property
    def writable_store(self) -> Store:
        """The local store, created when missing (compile, import, pull write into it)."""
        if self._store is None:
            self._store = Store(self.store_path, create=True, max_size=self.settings.max_size)
        return self._store

    def remote(self, url: str | None = None, required: str = "") -> Any:
        """The remote store (``url`` overrides the configured one); with ``required`` (the
        command's name) a missing remote is an error naming the fix, else None."""
        from aotc.fleet.remote import RemoteError, make_remote

        if url:
            return make_remote(url, self.settings, self.endpoint_url)
        if self.remote_url is None:
            if required:
                raise RemoteError(f"`aotc {required}` needs a remote store: pass --store "
                                  "s3://bucket/prefix, --remote URL or set AOTC_REMOTE")
            return None
        if self._remote is None:
            self._remote = make_remote(self.remote_url, self.settings, self.endpoint_url)
        return self._remote

    def context(self, store: Any = None, remote: Any = None, trust: Any = (),
                allow_unsigned: bool = False) -> Any:
        """The library's :class:`~aotc.context.Context` for this command: the settings read
        once by the group, with the command's store, remote, trusted keys and opt-out."""
        from aotc.context import Context

        return Context.from_settings(self.settings, store=store, remote=remote, trust=trust,
                                     allow_unsigned=allow_unsigned)

    def policy(self, trust: Any = (), allow_unsigned: bool = False) -> Any:
        """The trust policy: ``--trust`` keys and ``--allow-unsigned`` with the settings'."""
        from aotc.fleet.trust import trust_policy

        return trust_policy(trust, self.settings, allow_unsigned)

    def local_only(self, command: str) -> None:
        """Refuse a command that works on a local store when ``--store`` names a remote one."""
        if self.store_is_remote:
            from aotc.fleet.remote import RemoteError

            raise RemoteError(f"`aotc {command}` works on a local store and --store names the "
                              f"remote {self.remote_url}; pull what you need first (`aotc pull`) "
                              "and pass a local --store, or use --remote for the remote")


pass_app = click.make_pass_decorator(AppContext)


class AotcClickError(click.ClickException):
    """An ``AotcError`` shown as ``Error: <one line>`` with the error's exit code."""

    def __init__(self, err: AotcError) -> None:
        super().__init__(" ".join(str(err).split()))
        self.exit_code = err.exit_code  # type: ignore[misc]  # click reads it per instance


def guard(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Decorator for command callbacks: turn ``AotcError`` into a one-line click error."""
    import functools

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except AotcError as err:
            raise AotcClickError(err) from err

    return wrapper


def run_cli(group: click.Group, argv: list[str]) -> Any:
    """Run the click group (standalone: click prints errors and exits)."""
    return group.main(args=argv, prog_name="aotc")


def print_json(obj: Any) -> None:
    """One JSON object on stdout."""
    click.echo(json.dumps(obj, indent=2, sort_keys=True, default=str))


def echo_err(msg: str) -> None:
    """Progress and notes go to stderr so stdout stays clean for --json."""
    click.echo(msg, err=True)
