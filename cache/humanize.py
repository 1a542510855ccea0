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
    delta = max(0.0, (time.time() if now is None else now) - timestamp)
    for unit, seconds in (("d", 86400), ("h", 3600), ("m", 60)):
        if delta >= seconds:
            return f"{int(delta // seconds)}{unit} ago"
    return f"{int(delta)}s ago"
