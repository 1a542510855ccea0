"""aotc's logger: the library reports through ``logging`` (the ``aotc`` logger and its children)
and prints nothing itself; a server configures it as it configures any other library's.

With no logging configured anywhere, Python's last-resort handler still shows warnings on stderr
(a fallback, a failed push), one line each. ``AOTC_LOG=info`` (or ``debug``) is the operator's
switch for the rest — the backend's per-graph line, progress of a pull — without writing code: it
gives the ``aotc`` logger one stderr handler of its own. The CLI writes its own lines and
progress to stderr directly.
"""

from __future__ import annotations

import logging
import sys

__all__ = ["LEVELS", "configure", "logger"]

LEVELS = {"debug": logging.DEBUG, "info": logging.INFO, "warning": logging.WARNING,
          "error": logging.ERROR}
_ROOT = "aotc"


def logger(name: str = "") -> logging.Logger:
    """The ``aotc`` logger, or its child ``aotc.<name>``."""
    return logging.getLogger(f"{_ROOT}.{name}" if name else _ROOT)


class _OwnHandler(logging.StreamHandler):
    """The stderr handler ``AOTC_LOG`` asks for (told apart from a server's own handlers)."""


def configure(level: str | None) -> None:
    """Apply ``AOTC_LOG``: give the ``aotc`` logger a stderr handler at ``level`` (once; a later
    call changes the level). ``None`` leaves logging as the process configured it."""
    if not level:
        return
    root = logger()
    own = next((h for h in root.handlers if isinstance(h, _OwnHandler)), None)
    if own is None:
        own = _OwnHandler(sys.stderr)
        own.setFormatter(logging.Formatter("%(message)s"))
        root.addHandler(own)
        root.propagate = False  # one line each, not also through a root handler
    root.setLevel(LEVELS[level])
    own.setLevel(LEVELS[level])
