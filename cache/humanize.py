"""Human-readable sizes and ages for tables (the raw ints stay in the dataclasses)."""

from __future__ import annotations

import time


def format_size(n: int) -> str:
    """1536 → '1.5K'; binary units, like ``du -h``."""
    value = float(n)
    for unit in ("B", "K", "M", "G", "T"):
        if abs(value) < 1024 or unit == "T":
            return f"{int(value)}{unit}" if unit == "B" else f"{value:.1f}{unit}"
        value /= 1024
    return f"{n}B"  # pragma: no cover


def format_age(timestamp: float, now: float | None = None) -> str:
    """Seconds since ``timestamp`` as '12s ago', '3m ago', '5h ago', '2d ago'; 'never' for 0."""
    if not timestamp:
        return "never"
    return f"{format_duration(max(0.0, (time.time() if now is None else now) - timestamp))} ago"


def format_duration(seconds: float) -> str:
    """A span in its largest whole unit: 12 → '12s', 200 → '3m', 18000 → '5h', 2 days → '2d'."""
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= size:
            return f"{int(seconds // size)}{unit}"
    return f"{int(seconds)}s"
