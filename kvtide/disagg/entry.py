"""The bytes a block takes in a shared store (Redis): a header that lets a reader detect a truncated,
corrupted, foreign or forged entry, then the payload.

    b"KVT2" | layout id (16 ascii) | payload length (u64) | xxh3-64 of the payload (u64)
            | HMAC-SHA256(secret, "kv-tier-entry", store key, layout id, payload) (32) | payload

The MAC, under the deployment's KV secret, binds the payload to the key it is stored under: anyone
else who can write to the store (another tenant, a compromised client) cannot make an entry a
reader accepts, nor move a genuine entry to another prompt's key. The xxh3 checksum is what tells
damage (a truncated or flipped entry: `CORRUPT`) from forgery (a well-formed entry whose MAC is
wrong, or an unsigned one of the older KVT1 format: `FORGED`) in the counters operators read. A
reader that finds anything off computes the block instead.
"""

from __future__ import annotations

import struct

import xxhash

from kvtide.net_auth import MAC_BYTES, same_mac, sign

MAGIC = b"KVT2"
UNSIGNED_MAGIC = b"KVT1"
"""The format before entries were signed: read as forged (it proves nothing about its writer)."""
_HEADER = struct.Struct(f"<4s16sQQ{MAC_BYTES}s")
_TAG = b"kv-tier-entry"
CORRUPT = "corrupt"
FORGED = "forged"


def _mac(secret: bytes, key: bytes, layout_id: str, payload: bytes) -> bytes:
    return sign(secret, _TAG, key, layout_id.encode("ascii"), payload)


def pack(secret: bytes, key: bytes, layout_id: str, payload: bytes) -> bytes:
    return _HEADER.pack(MAGIC, layout_id.encode("ascii"), len(payload), xxhash.xxh3_64_intdigest(payload),
                        _mac(secret, key, layout_id, payload)) + payload


def unpack(secret: bytes, key: bytes, layout_id: str, blob: bytes | None) -> bytes | str | None:
    """The payload stored under `key`; None when `blob` is missing; CORRUPT when it is truncated,
    damaged or of another layout; FORGED when it is unsigned or its MAC is not this deployment's."""
    if blob is None:
        return None
    if blob[:4] == UNSIGNED_MAGIC:
        return FORGED
    if len(blob) < _HEADER.size:
        return CORRUPT
    magic, layout, length, digest, mac = _HEADER.unpack_from(blob)
    payload = blob[_HEADER.size:]
    if magic != MAGIC or layout != layout_id.encode("ascii") or length != len(payload):
        return CORRUPT
    if xxhash.xxh3_64_intdigest(payload) != digest:
        return CORRUPT
    if not same_mac(_mac(secret, key, layout_id, payload), mac):
        return FORGED
    return payload


def checksum(payload: bytes) -> int:
    return xxhash.xxh3_64_intdigest(payload)
