"""Shared-secret authentication for kvtide's cluster traffic: the p2p KV port, the data-parallel
rendezvous and the Redis KV tier all prove "made by this deployment" with HMAC-SHA256 under a
secret every instance of the deployment holds (never sent, never logged).

A MAC covers several parts, each prefixed with its length, so no two different part lists sign
alike (b"ab", b"c" vs b"a", b"bc"); the first part names what is signed (a purpose tag such as
b"dp-join"), so a MAC made for one message can never be replayed as another kind.
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import secrets

LOOPBACK_NAMES = ("localhost",)
"""Host names that always mean this machine (besides 127.0.0.0/8 and ::1 literals)."""


def is_loopback(hostname: str) -> bool:
    """`hostname` (no port; an IPv6 literal with or without brackets) names this machine: what
    decides whether a port is reachable only from here (a name may resolve to any interface)."""
    name = hostname.strip("[]").lower().rstrip(".")
    if name in LOOPBACK_NAMES:
        return True
    try:
        return ipaddress.ip_address(name).is_loopback
    except ValueError:
        return False


MAC_BYTES = 32
"""Length of a MAC (HMAC-SHA256)."""
NONCE_BYTES = 16


def hmac_sha256(secret: bytes, data: bytes) -> bytes:
    """The MAC of one message whose bytes say what they are (the p2p port's JSON, whose wire
    format predates `sign`: kept so prefill and decode pools of two releases still talk)."""
    return hmac.new(secret, data, hashlib.sha256).digest()


def sign(secret: bytes, *parts: bytes) -> bytes:
    mac = hmac.new(secret, digestmod=hashlib.sha256)
    for part in parts:
        mac.update(len(part).to_bytes(8, "little"))
        mac.update(part)
    return mac.digest()


def same_mac(expected: bytes, got: object) -> bool:
    """Whether `got` is the MAC `expected`, in constant time; anything not bytes is False."""
    return isinstance(got, bytes) and hmac.compare_digest(expected, got)


def new_nonce() -> bytes:
    return secrets.token_bytes(NONCE_BYTES)
