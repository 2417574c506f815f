"""BlockPool: KV blocks, their ref counts, the LRU free queue and the prefix-cache map.

It knows nothing of requests: the manager decides who holds what, so every ref-count change goes
through `touch` / `get_new_blocks` / `free_blocks` here.

    free queue (LRU first) ──▶ [b7 (hash) ][ b2 ][ b9 (hash) ] ... ◀── freed blocks enter here
    A freed block keeps its hash and content; it is evicted (hash dropped) only when popped for reuse.
    A block with ref_cnt > 0 is never in the free queue, so it can never be evicted.

A published block also records the block it was computed after (`parent`: block id and
`generation`, which counts reallocations), so a lookup can check that a hit continues the very
chain it matched so far: a forged or colliding hash can then cost a hit, never wrong KV.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterable
from typing import Protocol

from kvtide.kv_cache.prefix_cache import BlockHash


class KVEventSink(Protocol):
    """What the pool tells of its prefix cache (kv_events/events.KVEventRecorder)."""

    def stored(self, key: BlockHash, parent_key: BlockHash | None) -> None: ...
    def removed(self, key: BlockHash) -> None: ...
    def cleared(self) -> None: ...


class KVCacheBlock:
    __slots__ = ("block_id", "ref_cnt", "block_hash", "generation", "parent")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_cnt = 0
        self.block_hash: BlockHash | None = None
        self.generation = 0
        """Times the block was handed out: its content changes only then."""
        self.parent: tuple[int, int] | None = None
        """(block_id, generation) of the block this one's KV was computed after (None: first block)."""

    def follows(self, prev: KVCacheBlock | None) -> bool:
        """Whether this cached block was computed right after `prev` as it is now (None: first)."""
        return self.parent == (None if prev is None else (prev.block_id, prev.generation))

    def __repr__(self) -> str:
        return f"KVCacheBlock(id={self.block_id}, ref={self.ref_cnt}, cached={self.block_hash is not None})"


class BlockPool:
    def __init__(self, num_blocks: int, enable_caching: bool = True) -> None:
        assert num_blocks > 0
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks = [KVCacheBlock(i) for i in range(num_blocks)]
        # block_id -> block, in LRU order (first = evicted first). OrderedDict gives O(1) removal
        # from the middle when a cached free block is hit again.
        self._free: OrderedDict[int, KVCacheBlock] = OrderedDict((b.block_id, b) for b in self.blocks)
        self._cached: dict[BlockHash, KVCacheBlock] = {}
        self.num_evictions = 0
        self.evict_listener: Callable[[int, BlockHash], None] | None = None
        """Told (block id, key) as a published block is taken for reuse, before anyone writes it
        (a KV connector's host-memory tier copies it out)."""
        self.event_sink: KVEventSink | None = None
        """Told every key published, dropped and cleared (kv_events/: --kv-events-config); only
        keys of the first layer group (BlockHash, not a group's (group, BlockHash) tuple)."""

    # ---- queries -------------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        """Blocks that can be handed out now (truly free + cached-but-evictable)."""
        return len(self._free)

    @property
    def num_evictable_blocks(self) -> int:
        """Free blocks that still hold a cached prefix."""
        return sum(1 for b in self._free.values() if b.block_hash is not None)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self._free)

    def usage(self) -> float:
        """Fraction of blocks held by live requests (cached-but-evictable blocks count as free)."""
        return self.num_used_blocks / self.num_blocks

    def get_cached_block(self, block_hash: BlockHash) -> KVCacheBlock | None:
        return self._cached.get(block_hash)

    # ---- ref counting --------------------------------------------------------------------
    def get_new_blocks(self, n: int) -> list[KVCacheBlock]:
        if n > len(self._free):
            raise ValueError(f"cannot allocate {n} blocks, only {len(self._free)} free")
        out = []
        for _ in range(n):
            _, block = self._free.popitem(last=False)
            self._evict(block)
            assert block.ref_cnt == 0
            block.ref_cnt = 1
            block.generation += 1
            block.parent = None
            out.append(block)
        return out

    def touch(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Take one more reference on blocks (prefix hit or fork); a free one leaves the queue."""
        for block in blocks:
            if block.ref_cnt == 0:
                del self._free[block.block_id]
            block.ref_cnt += 1

    def free_blocks(self, ordered_blocks: Iterable[KVCacheBlock]) -> None:
        """Drop one reference each; blocks reaching 0 join the queue in the given order (evicted first)."""
        for block in ordered_blocks:
            assert block.ref_cnt > 0, f"double free of {block}"
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self._free[block.block_id] = block

    # ---- prefix cache --------------------------------------------------------------------
    def cache_block(self, block: KVCacheBlock, block_hash: BlockHash,
                    parent: KVCacheBlock | None = None, parent_key: BlockHash | None = None) -> None:
        """Publish a full block under its key; `parent` is the (published) block its KV was
        computed after, `parent_key` that block's key (for the event sink). A key already published
        keeps its first block, unless that block was computed after another parent: then it is
        stale (its parent is gone) and is replaced."""
        if not self.enable_caching or block.block_hash is not None:
            return
        block.parent = None if parent is None else (parent.block_id, parent.generation)
        existing = self._cached.get(block_hash)
        sink = self.event_sink if isinstance(block_hash, BlockHash) else None
        if existing is not None:
            if existing.parent == block.parent:
                return
            existing.block_hash = None  # unreachable for lookups now; keeps its KV, stops being cached
            if sink is not None:
                sink.removed(block_hash)
        block.block_hash = block_hash
        self._cached[block_hash] = block
        if sink is not None:
            sink.stored(block_hash, parent_key)

    def _evict(self, block: KVCacheBlock) -> None:
        if block.block_hash is None:
            return
        if self._cached.get(block.block_hash) is block:
            del self._cached[block.block_hash]
            if self.evict_listener is not None:
                self.evict_listener(block.block_id, block.block_hash)
            if self.event_sink is not None and isinstance(block.block_hash, BlockHash):
                self.event_sink.removed(block.block_hash)
        block.block_hash = None
        self.num_evictions += 1

    def reset_prefix_cache(self) -> bool:
        """Forget every cached-but-free block. Refused (False) while any block is in use."""
        if self.num_used_blocks:
            return False
        for block in self.blocks:
            block.block_hash = None
        self._cached.clear()
        if self.event_sink is not None:
            self.event_sink.cleared()
        return True

    def cached_keys(self) -> list[BlockHash]:
        """The first layer group's published keys (what the event sink has been told is stored)."""
        return [key for key in self._cached if isinstance(key, BlockHash)]

    def check_integrity(self) -> None:
        """free + in use == total; the queue holds exactly the blocks with ref_cnt 0; every cached
        key points at a block carrying that key."""
        in_use = [b for b in self.blocks if b.ref_cnt > 0]
        assert all(b.ref_cnt >= 0 for b in self.blocks)
        assert len(in_use) + len(self._free) == self.num_blocks, (len(in_use), len(self._free))
        assert all(b.ref_cnt == 0 for b in self._free.values())
        for key, block in self._cached.items():
            assert block.block_hash == key
