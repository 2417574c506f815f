"""Prefix-cache keys: a chain of block hashes over token ids.

    block i's key = H(key of block i-1, token ids of block i, extra keys)

Only full blocks get a key. The first block mixes in per-request extra keys (cache_salt, adapter
id), so tenants never share KV. H is sha256 (default) or xxh128 over bytes, never Python's
hash(), which is salted per process and weak against crafted inputs.
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Callable, Sequence
from typing import NamedTuple

import xxhash

HashFn = Callable[[bytes], bytes]

HASH_FUNCTIONS: dict[str, HashFn] = {
    "sha256": lambda data: hashlib.sha256(data).digest(),
    "xxh128": lambda data: xxhash.xxh3_128_digest(data),
}

_ROOT = b"kvtide-root"


class BlockHash(NamedTuple):
    """Key of a full block. The token ids (and a first block's extra keys) are part of the key, so
    a hash collision between blocks with different tokens or salts can never match; the pool's
    parent check covers the rest of the prefix."""

    hash_value: bytes
    token_ids: tuple[int, ...]
    extra_keys: bytes = b""


def get_hash_fn(name: str) -> HashFn:
    if name not in HASH_FUNCTIONS:
        raise ValueError(f"prefix_caching_hash_algo must be one of {sorted(HASH_FUNCTIONS)}, got {name!r}")
    return HASH_FUNCTIONS[name]


def hash_block_tokens(hash_fn: HashFn, parent: BlockHash | None, token_ids: Sequence[int],
                      extra_keys: bytes = b"") -> BlockHash:
    parent_bytes = parent.hash_value if parent is not None else _ROOT
    payload = parent_bytes + array("q", token_ids).tobytes() + extra_keys
    return BlockHash(hash_fn(payload), tuple(token_ids), extra_keys)


def extra_keys_for(cache_salt: str | None, lora_int_id: int | None = None) -> bytes:
    salt = b"" if cache_salt is None else b"salt:" + cache_salt.encode("utf-8")
    return salt if lora_int_id is None else salt + b"lora:" + str(lora_int_id).encode()


def hash_request_blocks(hash_fn: HashFn, token_ids: Sequence[int], block_size: int,
                        existing: list[BlockHash], cache_salt: str | None = None,
                        lora_int_id: int | None = None) -> None:
    """Extend `existing` in place with the keys of every full block of `token_ids` not yet hashed.
    A LoRA adapter's id joins the first block's extra keys: its KV is its own."""
    num_full = len(token_ids) // block_size
    parent = existing[-1] if existing else None
    for i in range(len(existing), num_full):
        extra = extra_keys_for(cache_salt, lora_int_id) if i == 0 else b""
        parent = hash_block_tokens(hash_fn, parent, token_ids[i * block_size:(i + 1) * block_size], extra)
        existing.append(parent)
