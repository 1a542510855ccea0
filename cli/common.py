"""Shared CLI plumbing: the lazily built Store, error mapping, JSON printing."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any, Callable

import click

from aotc.cache.errors import AotcError
from aotc.cache.store import Store, default_store_path


class AppContext:
    """What the group callback resolves once and every command receives: the store location and,
    on first use, the ``Store`` itself."""

    def __init__(self, store_path: str | None) -> None:
        self.store_path = Path(store_path).expanduser() if store_path else default_store_path()
        self._store: Store | None = None

    @property
    def store(self) -> Store:
        if self._store is None:
            self._store = Store(self.store_path)
        return self._store


pass_app = click.make_pass_decorator(AppContext)


class AotcClickError(click.ClickException):
    """An ``AotcError`` shown as ``Error: <one line>`` with the error's exit code."""

    def __init__(self, err: AotcError) -> None:
        super().__init__(" ".join(str(err).split()))
        self.exit_code = err.exit_code


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


def run_guarded(group: click.Group, argv: list[str]) -> Any:
    """Run the click group (standalone: click prints errors and exits)."""
    return group.main(args=argv, prog_name="aotc")


def print_json(obj: Any) -> None:
    """One JSON object on stdout."""
    click.echo(json.dumps(obj, indent=2, sort_keys=True, default=str))


def echo_err(msg: str) -> None:
    """Progress and notes go to stderr so stdout stays clean for --json."""
    click.echo(msg, err=True)


def stderr_is_tty() -> bool:
    return sys.stderr.isatty()
