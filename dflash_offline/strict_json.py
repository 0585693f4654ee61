"""Strict JSON for what the package writes for other programs (``dflash sql --format json/jsonl``,
``RUN/metrics.jsonl``): a non-finite float is written as ``null``.

Python's ``json`` writes ``NaN`` and ``Infinity`` by default, which no strict parser (``jq``, browsers,
Go, Rust's serde_json) accepts; one diverged loss would make a whole metrics file unreadable to them.
``allow_nan=False`` then guarantees that nothing non-finite slipped through the mapping.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from typing import Any


def finite_or_none(value: Any) -> Any:
    """``value`` with every NaN/±inf float, at any depth of dicts, lists and tuples, replaced by None."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: finite_or_none(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [finite_or_none(v) for v in value]
    return value


def dumps(value: Any, *, default: Callable[[Any], Any] | None = None, indent: int | None = None) -> str:
    """``json.dumps`` that writes ``null`` for a non-finite float (also one ``default`` returned)."""

    def strict_default(obj: Any) -> Any:
        assert default is not None
        return finite_or_none(default(obj))

    return json.dumps(
        finite_or_none(value),
        allow_nan=False,
        default=None if default is None else strict_default,
        indent=indent,
    )
