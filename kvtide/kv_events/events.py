"""The KV events on the wire, as vLLM's `KVEventBatch` (msgpack of msgspec structs, array-like,
events tagged by class name), and the recorder the block pool reports to.

    KVEventBatch = [ts, [event, ...], data_parallel_rank?]
    BlockStored  = ["BlockStored", block_hashes, parent_block_hash, token_ids, block_size, lora_id, medium]
    BlockRemoved = ["BlockRemoved", block_hashes, medium]
    AllBlocksCleared = ["AllBlocksCleared"]

A block hash goes out as vLLM sends it by default: the last 8 bytes of the block's key, as an
unsigned big-endian integer.
"""

from __future__ import annotations

from typing import Any

import msgspec


class KVCacheEvent(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag=True):
    """One change to the set of cached blocks."""


class BlockStored(KVCacheEvent):
    block_hashes: list[int]
    """A chain: each block computed after the one before it, the first after `parent_block_hash`."""
    parent_block_hash: int | None
    token_ids: list[int]
    """The blocks' tokens, block after block."""
    block_size: int
    lora_id: int | None
    medium: str | None


class BlockRemoved(KVCacheEvent):
    block_hashes: list[int]
    medium: str | None


class AllBlocksCleared(KVCacheEvent):
    pass


class KVEventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]
    data_parallel_rank: int | None = None


def external_block_hash(key: Any) -> int:
    """The hash a subscriber sees for a prefix-cache key (kv_cache/prefix_cache.BlockHash)."""
    return int.from_bytes(key.hash_value[-8:], "big")


def lora_id_of(extra_keys: bytes) -> int | None:
    """The adapter id a first block's extra keys name (kv_cache/prefix_cache.extra_keys_for), if any."""
    _, found, rest = extra_keys.partition(b"lora:")
    return int(rest) if found and rest.isdigit() else None


class KVEventRecorder:
    """Collects the block pool's changes between two engine steps (`take` drains them).

    Consecutive stores of one chain become one BlockStored, consecutive removals one BlockRemoved,
    so a step's events stay about as many as the requests it touched. Only the pool's first layer
    group is told (the keys of a hybrid model's other groups are the same prefixes again)."""

    def __init__(self, medium: str | None = None) -> None:
        self.medium = medium
        self._pending: list[KVCacheEvent] = []
        self._lora_of: dict[int, int] = {}
        """Stored block hash -> its LoRA adapter id, for blocks computed under one (a chain's
        first block carries the id in its key's extra keys; the rest inherit it)."""

    def stored(self, key: Any, parent_key: Any | None) -> None:
        block_hash = external_block_hash(key)
        parent = None if parent_key is None else external_block_hash(parent_key)
        lora_id = lora_id_of(key.extra_keys) if parent is None else self._lora_of.get(parent)
        if lora_id is not None:
            self._lora_of[block_hash] = lora_id
        last = self._pending[-1] if self._pending else None
        if isinstance(last, BlockStored) and parent is not None and last.block_hashes[-1] == parent \
                and last.block_size == len(key.token_ids) and last.lora_id == lora_id:
            last.block_hashes.append(block_hash)
            last.token_ids.extend(key.token_ids)
            return
        self._pending.append(BlockStored([block_hash], parent, list(key.token_ids), len(key.token_ids), lora_id,
                                         self.medium))

    def removed(self, key: Any) -> None:
        block_hash = external_block_hash(key)
        self._lora_of.pop(block_hash, None)
        last = self._pending[-1] if self._pending else None
        if isinstance(last, BlockRemoved):
            last.block_hashes.append(block_hash)
        else:
            self._pending.append(BlockRemoved([block_hash], self.medium))

    def cleared(self) -> None:
        self._pending = [AllBlocksCleared()]
        self._lora_of.clear()

    def take(self) -> list[KVCacheEvent]:
        """The events since the last call, oldest first."""
        events, self._pending = self._pending, []
        return events
