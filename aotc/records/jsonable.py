"""``to_json()`` for result records whose JSON is exactly their fields."""

from __future__ import annotations

import dataclasses
from typing import Any


class FieldsAsJson:
    """Mixin for a dataclass: ``to_json()`` is ``dataclasses.asdict(self)``."""

    def to_json(self) -> dict[str, Any]:
        """The record's fields as a JSON-able dict."""
        return dataclasses.asdict(self)  # type: ignore[call-overload]  # mixed into dataclasses only
