"""JSON that every parser reads: standard JSON has no Infinity or NaN, which Python's ``json``
writes bare (``jq``, JavaScript's ``JSON.parse`` and most others refuse them). Non-finite
numbers are written as the strings ``"Infinity"``, ``"-Infinity"`` and ``"NaN"`` and read back
as floats."""

from __future__ import annotations

import json
import math
from typing import Any

__all__ = ["dumps", "loads"]

_SPELLING = {math.inf: "Infinity", -math.inf: "-Infinity"}
_VALUE = {"Infinity": math.inf, "-Infinity": -math.inf, "NaN": math.nan}


def _encoded(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return "NaN" if math.isnan(value) else _SPELLING[value]
    if isinstance(value, dict):
        return {key: _encoded(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [_encoded(item) for item in value]
    return value


def _decoded(value: Any) -> Any:
    if isinstance(value, str):
        return _VALUE.get(value, value)
    if isinstance(value, dict):
        return {key: _decoded(item) for key, item in value.items()}
    if isinstance(value, list):
        return [_decoded(item) for item in value]
    return value


def dumps(value: Any) -> str:
    """``value`` as standard JSON, non-finite floats as their strings."""
    return json.dumps(_encoded(value), allow_nan=False)


def loads(text: str) -> Any:
    """What :func:`dumps` wrote, the strings of non-finite floats as floats."""
    return _decoded(json.loads(text))
