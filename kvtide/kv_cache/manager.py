"""KVCacheManager: the per-request facade over the BlockPool.

It owns request -> blocks, so every ref-count change for a request happens here:

    get_computed_blocks(req)            longest cached prefix (no allocation, no ref change)
    allocate_slots(req, n, hits)        take the hits + enough new blocks for n more tokens, or None
    free(req)                           drop the request's references (tail blocks evicted first)

Block tables are append-only while a request lives; preemption frees them whole.

    request blocks:  [ b3 | b8 | b1 | b4 ]      block_size = 4
    tokens:           0123 4567 89.. ....
                      └─ full, hashed ─┘└ partial: filled as tokens are computed
"""

from __future__ import annotations

from dataclasses import dataclass

from kvtide.engine.request import Request
from kvtide.kv_cache.block_pool import BlockPool, KVCacheBlock
from kvtide.kv_cache.prefix_cache import get_hash_fn, hash_request_blocks


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclass
class PrefixCacheStats:
    """Counters in tokens: how many prompt tokens were looked up and how many were hits."""

    queries: int = 0
    hits: int = 0
    requests: int = 0


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool = True,
                 hash_algo: str = "sha256") -> None:
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.hash_fn = get_hash_fn(hash_algo)
        self.pool = BlockPool(num_blocks, enable_caching)
        self.req_to_blocks: dict[str, list[KVCacheBlock]] = {}
        self._num_cached_blocks: dict[str, int] = {}
        self.prefix_stats = PrefixCacheStats()

    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    def usage(self) -> float:
        return self.pool.usage()

    def get_block_ids(self, request_id: str) -> list[int]:
        return [b.block_id for b in self.req_to_blocks.get(request_id, ())]

    # ---- prefix lookup ---------------------------------------------------------------------
    def _update_hashes(self, request: Request) -> None:
        if self.enable_caching:
            hash_request_blocks(self.hash_fn, request.all_token_ids, self.block_size,
                                request.block_hashes, request.sampling_params.cache_salt)

    def get_computed_blocks(self, request: Request) -> tuple[list[KVCacheBlock], int]:
        """The longest run of cached full blocks at the start of the request, and its length in
        tokens. At least the last token is always left to compute, so logits exist."""
        if not self.enable_caching or request.sampling_params.prompt_logprobs is not None:
            return [], 0
        self._update_hashes(request)
        max_hit_blocks = (request.num_tokens - 1) // self.block_size
        hits: list[KVCacheBlock] = []
        for block_hash in request.block_hashes[:max_hit_blocks]:
            block = self.pool.get_cached_block(block_hash)
            if block is None:
                break
            hits.append(block)
        num_hit_tokens = len(hits) * self.block_size
        if request.num_preemptions == 0:
            self.prefix_stats.requests += 1
            self.prefix_stats.queries += request.num_tokens
            self.prefix_stats.hits += num_hit_tokens
        return hits, num_hit_tokens

    def num_cached_prefix_tokens(self, token_ids: list[int], cache_salt: str | None = None) -> int:
        """Radix-style view: how many leading tokens of `token_ids` are cached now. Allocates nothing."""
        if not self.enable_caching:
            return 0
        hashes: list = []
        hash_request_blocks(self.hash_fn, token_ids, self.block_size, hashes, cache_salt)
        num = 0
        for block_hash in hashes:
            if self.pool.get_cached_block(block_hash) is None:
                break
            num += self.block_size
        return num

    # ---- allocation ------------------------------------------------------------------------
    def allocate_slots(self, request: Request, num_new_tokens: int,
                       new_computed_blocks: list[KVCacheBlock] | None = None,
                       num_new_computed_tokens: int = 0) -> list[KVCacheBlock] | None:
        """Make room for `num_new_tokens` more tokens after the computed ones (plus prefix hits).

        Returns the newly allocated blocks, or None, changing nothing, when the pool is short."""
        new_computed_blocks = new_computed_blocks or []
        req_blocks = self.req_to_blocks.setdefault(request.request_id, [])
        num_computed = request.num_computed_tokens + num_new_computed_tokens
        num_required = cdiv(num_computed + num_new_tokens, self.block_size)
        num_new_blocks = max(num_required - len(req_blocks) - len(new_computed_blocks), 0)
        # Hits sitting in the free queue stop being allocatable once we take them.
        num_hits_in_free_queue = sum(1 for b in new_computed_blocks if b.ref_cnt == 0)
        if num_new_blocks > self.pool.num_free_blocks - num_hits_in_free_queue:
            if not req_blocks:
                del self.req_to_blocks[request.request_id]
            return None
        self.pool.touch(new_computed_blocks)
        req_blocks.extend(new_computed_blocks)
        new_blocks = self.pool.get_new_blocks(num_new_blocks)
        req_blocks.extend(new_blocks)
        self._cache_full_blocks(request, num_computed + num_new_tokens)
        return new_blocks

    def _cache_full_blocks(self, request: Request, num_tokens_after_step: int) -> None:
        """Publish blocks that are full once this step's tokens are written."""
        if not self.enable_caching:
            return
        req_id = request.request_id
        num_full = min(num_tokens_after_step, request.num_tokens) // self.block_size
        start = self._num_cached_blocks.get(req_id, 0)
        if num_full <= start:
            return
        self._update_hashes(request)
        blocks = self.req_to_blocks[req_id]
        for i in range(start, num_full):
            self.pool.cache_block(blocks[i], request.block_hashes[i])
        self._num_cached_blocks[req_id] = num_full

    def free(self, request: Request) -> None:
        """Release the request's blocks; the tail goes first into the LRU queue, since a shared
        prefix's head is the part most likely to be hit again."""
        blocks = self.req_to_blocks.pop(request.request_id, [])
        self._num_cached_blocks.pop(request.request_id, None)
        self.pool.free_blocks(reversed(blocks))

    def reset_prefix_cache(self) -> bool:
        return self.pool.reset_prefix_cache()

    def check_integrity(self) -> None:
        """Pool invariants, plus: each block's ref count equals the number of live tables holding it."""
        self.pool.check_integrity()
        holders: dict[int, int] = {}
        for blocks in self.req_to_blocks.values():
            for b in blocks:
                holders[b.block_id] = holders.get(b.block_id, 0) + 1
        for block in self.pool.blocks:
            assert block.ref_cnt == holders.get(block.block_id, 0), (block, holders.get(block.block_id))
