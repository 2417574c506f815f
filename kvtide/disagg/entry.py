"""The bytes a block takes outside the process: a header that lets a reader detect a truncated,
corrupted or foreign entry, then the payload.

    b"KVT1" | layout id (16 ascii) | payload length (u64) | xxh3-64 of the payload (u64) | payload

A reader that finds anything off gets None and computes the block instead.
"""

from __future__ import annotations

import struct

import xxhash

MAGIC = b"KVT1"
_HEADER = struct.Struct("<4s16sQQ")


def pack(layout_id: str, payload: bytes) -> bytes:
    return _HEADER.pack(MAGIC, layout_id.encode("ascii"), len(payload), xxhash.xxh3_64_intdigest(payload)) + payload


def unpack(layout_id: str, blob: bytes | None) -> bytes | None:
    """The payload, or None when `blob` is missing, truncated, corrupted or of another layout."""
    if blob is None or len(blob) < _HEADER.size:
        return None
    magic, layout, length, digest = _HEADER.unpack_from(blob)
    payload = blob[_HEADER.size:]
    if magic != MAGIC or layout != layout_id.encode("ascii") or length != len(payload):
        return None
    if xxhash.xxh3_64_intdigest(payload) != digest:
        return None
    return payload


def checksum(payload: bytes) -> int:
    return xxhash.xxh3_64_intdigest(payload)
