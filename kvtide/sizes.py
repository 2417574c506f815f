"""Byte sizes as flags take them ('2GiB', '512MiB', '1e9'), kept free of torch so the server's
front end can parse its flags without importing it."""

from __future__ import annotations

import re

_SIZE_UNITS = {"": 1, "b": 1, "k": 1000, "kb": 1000, "m": 1000**2, "mb": 1000**2, "g": 1000**3,
               "gb": 1000**3, "kib": 1024, "mib": 1024**2, "gib": 1024**3, "tib": 1024**4}


def parse_size(value: int | str, what: str = "kv_cache_memory") -> int:
    """'2GiB' / '512MiB' / '1e9' / 123 -> bytes; `what` names the setting in the error."""
    if isinstance(value, int):
        size = value
    else:
        match = re.fullmatch(r"\s*([0-9.eE+]+)\s*([a-zA-Z]*)\s*", str(value))
        unit = match.group(2).lower() if match else ""
        if not match or unit not in _SIZE_UNITS:
            raise ValueError(f"{what}: cannot parse {value!r}; use bytes or e.g. '2GiB', '512MiB'")
        size = int(float(match.group(1)) * _SIZE_UNITS[unit])
    if size <= 0:
        raise ValueError(f"{what} must be > 0 bytes, got {value!r}")
    return size
