"""Options several commands share, as decorators (the sqlite-utils ``cli.py`` style)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import click

F = Callable[..., Any]


def json_option(fn: F) -> F:
    """``--json``: one JSON object on stdout instead of text (the ``as_json`` argument)."""
    return click.option("--json", "as_json", is_flag=True, help="Print one JSON object on stdout.")(fn)


def trust_option(fn: F) -> F:
    """``--trust PUBKEY`` (repeatable): require / accept a signature by that key, besides
    ``AOTC_TRUST_KEYS`` (the ``trust`` argument)."""
    return click.option("--trust", multiple=True, metavar="PUBKEY",
                        help="A trusted public key (hex, or a file holding one); adds to "
                             "AOTC_TRUST_KEYS.")(fn)


def allow_unsigned_option(fn: F) -> F:
    """``--allow-unsigned``: accept entries from another machine that no trusted key signed (the
    explicit opt-out; ``AOTC_ALLOW_UNSIGNED=1`` does the same; the ``allow_unsigned`` argument)."""
    return click.option("--allow-unsigned", is_flag=True,
                        help="Accept entries from a remote or bundle that no trusted key signed "
                             "(as AOTC_ALLOW_UNSIGNED=1).")(fn)


def quiet_option(fn: F) -> F:
    """``-q/--quiet``: no progress on stderr (the ``quiet`` argument)."""
    return click.option("-q", "--quiet", is_flag=True, help="No progress on stderr.")(fn)
