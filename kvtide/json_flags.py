"""Flags that take a JSON object (`--kv-transfer-config '{...}'`) or, from Python, the dict itself."""

from __future__ import annotations

import json
from typing import Any


def json_object_flag(value: str | dict, flag: str) -> dict[str, Any]:
    """The object a flag's JSON text (or dict) holds; ValueError naming the flag otherwise."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as e:
            raise ValueError(f"{flag} is not valid JSON: {e}") from None
    if not isinstance(value, dict):
        raise ValueError(f"{flag} must be a JSON object")
    return value
