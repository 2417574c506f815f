"""KVCacheManager: the per-request facade over the BlockPool.

It owns request -> blocks, so every ref-count change for a request happens here:

    get_computed_blocks(req)            longest cached prefix (no allocation, no ref change)
    allocate_slots(req, n, hits)        take the hits + enough new blocks for n more tokens, or None
    free(req)                           drop the request's references (tail blocks evicted first)
    fork(parent, child)                 the child shares the parent's computed blocks (ref counts)

Block tables are append-only while a request lives, with two exceptions: copy-on-write replaces a
shared block the request is about to write into (a forked partial block), and under a sliding
window a block no later query reads is given back, its entry replaced by a `FreedBlock`;
preemption frees them whole.

    request blocks:  [ b3 | b8 | b1 | b4 ]      block_size = 4
    tokens:           0123 4567 89.. ....
                      └─ full, hashed ─┘└ partial: filled as tokens are computed

Sliding window W with S sink tokens (a query at p sees keys j <= p with j > p - W, or j < S):
once a step starts at position c, a block wholly before c - W + 1 that holds no sink is never read
again, so it goes back to the pool when the step is allocated. The table keeps its length
(position p stays at index p // block_size), so a long request holds O(W + S) blocks.

    W = 6, S = 0, block_size = 4, step starts at c = 13 (keys >= 8 are read):
    request blocks:  [ freed | freed | b1 | b4 ]
"""

from __future__ import annotations

from dataclasses import dataclass

from kvtide.engine.request import Request
from kvtide.kv_cache.block_pool import BlockPool, KVCacheBlock
from kvtide.kv_cache.prefix_cache import get_hash_fn, hash_request_blocks
from kvtide.kv_compression.score_dropping import blocks_to_drop


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class FreedBlock:
    """A table entry whose block went back to the pool because it lies wholly outside the
    attention window: no later query of the request reads it.

    `block_id` is a real block id (the block it was, or the published block holding the same KV),
    so block tables may show it: every attention backend masks keys by position, so whoever holds
    that block now, it is only ever read under a zero weight. (block_id, generation) is also the
    entry's lineage, the parent the next block is published under (`KVCacheBlock.parent`): the
    pool reads just these two fields, and a parent reallocated since (a newer generation) can
    only cost a hit, never match a wrong chain."""

    __slots__ = ("block_id", "generation")

    def __init__(self, block_id: int, generation: int) -> None:
        self.block_id = block_id
        self.generation = generation

    def __repr__(self) -> str:
        return f"FreedBlock(id={self.block_id}, gen={self.generation})"


TableEntry = KVCacheBlock | FreedBlock
DROPPED_BLOCK_ID = -1
"""A FreedBlock with this id was dropped by the score policy (anywhere in the table, unlike window
freeing): the runner's table shows -1 there, which every backend masks."""


def max_blocks_held(num_tokens: int, max_step_tokens: int, block_size: int, sliding_window: int | None,
                    sink_tokens: int = 0) -> int:
    """The most blocks a request of `num_tokens` KV tokens holds at once when no step computes
    more than `max_step_tokens` tokens: all of them, or under a window the sink blocks plus the
    blocks from the window's first key to the end of a step. A step starting at c holds blocks
    floor((c - W + 1) / B) .. cdiv(c + n, B) - 1, at most cdiv(W + n + B - 2, B) of them."""
    full = cdiv(num_tokens, block_size)
    if sliding_window is None:
        return full
    step = min(max_step_tokens, num_tokens)
    window = cdiv(sliding_window + step + block_size - 2, block_size)
    return min(full, cdiv(sink_tokens, block_size) + window)


@dataclass
class SlotPlan:
    """What `allocate_slots` would take, worked out before anything is taken, so that a hybrid
    manager (kv_cache/hybrid.py) can check every layer group's need against their one pool first."""

    req_blocks: list[TableEntry]
    num_new_computed_tokens: int
    num_tokens_after: int
    """Tokens in the request's KV once the step is computed."""
    hits: list[TableEntry]
    live_hits: list[KVCacheBlock]
    num_new_blocks: int
    to_copy: list[int]
    """Table indices of shared or published blocks the step writes into (copied first)."""

    @property
    def blocks_needed(self) -> int:
        """Blocks the plan takes off the free queue: new ones, copies, and hits sitting there."""
        return self.num_new_blocks + len(self.to_copy) + sum(1 for b in self.live_hits if b.ref_cnt == 0)


@dataclass
class PrefixCacheStats:
    """Counters in tokens: how many prompt tokens were looked up and how many were hits."""

    queries: int = 0
    hits: int = 0
    requests: int = 0


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool = True,
                 hash_algo: str = "sha256", sliding_window: int | None = None,
                 sink_tokens: int = 0, drop_budget: float | None = None, pool: BlockPool | None = None,
                 group_id: int = 0) -> None:
        if sliding_window is not None and sliding_window < 1:
            raise ValueError(f"sliding_window must be >= 1, got {sliding_window}")
        if sink_tokens < 0:
            raise ValueError(f"sink_tokens must be >= 0, got {sink_tokens}")
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.hash_fn = get_hash_fn(hash_algo)
        self.pool = pool if pool is not None else BlockPool(num_blocks, enable_caching)
        self.group_id = group_id
        """The layer group this manager keeps tables for (a hybrid manager runs one per group over one
        shared pool, kv_cache/hybrid.py). Group 0 counts the prefix-cache stats; the keys of the other
        groups' published blocks carry their group, so no two groups ever share a block."""
        self.sliding_window = sliding_window
        """Every query attends within this window (plus the sinks); None: full attention, nothing freed."""
        self.sink_tokens = sink_tokens
        self._num_sink_blocks = cdiv(sink_tokens, block_size)
        """Blocks holding a sink position: never freed while the request lives."""
        self.drop_budget = drop_budget
        """The score drop policy's fraction of a request's blocks kept (kv_compression/score_dropping.py);
        None: no block is dropped."""
        self._block_mass: dict[str, list[float]] = {}
        """request id -> attention mass each of its blocks received so far (the score drop policy)."""
        self._dropped: dict[str, list[int]] = {}
        """request id -> table indices dropped since take_dropped() last reported them."""
        self.req_to_blocks: dict[str, list[TableEntry]] = {}
        self._num_cached_blocks: dict[str, int] = {}
        self.prefix_stats = PrefixCacheStats()
        # Copy-on-write since the last take_block_copies(): (src, dst) block ids, and the requests
        # whose table had a block replaced (the runner needs their whole table again).
        self._block_copies: list[tuple[int, int]] = []
        self._rewritten_req_ids: set[str] = set()

    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    def usage(self) -> float:
        return self.pool.usage()

    def get_block_ids(self, request_id: str) -> list[int]:
        """The request's block table. A freed entry shows a real block id that the request no
        longer holds (see FreedBlock): it is never read unmasked."""
        return [b.block_id for b in self.req_to_blocks.get(request_id, ())]

    def num_live_blocks(self, request_id: str) -> int:
        """Blocks the request holds references on now (freed window entries excluded)."""
        return sum(1 for b in self.req_to_blocks.get(request_id, ()) if isinstance(b, KVCacheBlock))

    def max_blocks_held(self, num_tokens: int, max_step_tokens: int) -> int:
        """The most blocks a request of `num_tokens` KV tokens holds at once (max_blocks_held)."""
        return max_blocks_held(num_tokens, max_step_tokens, self.block_size, self.sliding_window, self.sink_tokens)

    # ---- prefix lookup ---------------------------------------------------------------------
    def _update_hashes(self, request: Request) -> None:
        if self.enable_caching:
            hash_request_blocks(self.hash_fn, request.all_token_ids, self.block_size,
                                request.block_hashes, request.sampling_params.cache_salt,
                                request.lora_request.lora_int_id if request.lora_request is not None else None)

    def get_computed_blocks(self, request: Request) -> tuple[list[KVCacheBlock], int]:
        """The longest run of cached full blocks at the start of the request, and its length in
        tokens. At least the last token is always left to compute, so logits exist."""
        if not self.enable_caching or _needs_whole_prompt(request):
            return [], 0
        self._update_hashes(request)
        max_hit_tokens = request.num_tokens - 1
        if request.sampling_params.prompt_logprobs is not None:  # the logits before the first wanted position
            max_hit_tokens = min(max_hit_tokens, request.sampling_params.prompt_logprobs_start - 1)
        max_hit_blocks = max_hit_tokens // self.block_size
        hits = self._longest_cached_chain(request.block_hashes[:max_hit_blocks])
        return hits, len(hits) * self.block_size

    def _key(self, block_hash):
        """The pool key of a block hash in this manager's layer group."""
        return block_hash if self.group_id == 0 else (self.group_id, block_hash)

    def _record_prefix_lookup(self, request: Request, num_hit_tokens: int) -> None:
        """Count a request's lookup once, when it is admitted: not each step it waits for blocks,
        nor its resume after a preemption."""
        if not self.enable_caching or _needs_whole_prompt(request) \
                or request.num_preemptions > 0 or self.group_id:
            return
        self.prefix_stats.requests += 1
        self.prefix_stats.queries += request.num_tokens
        self.prefix_stats.hits += num_hit_tokens

    def num_cached_prefix_tokens(self, token_ids: list[int], cache_salt: str | None = None) -> int:
        """Radix-style view: how many leading tokens of `token_ids` are cached now. Allocates nothing."""
        if not self.enable_caching:
            return 0
        hashes: list = []
        hash_request_blocks(self.hash_fn, token_ids, self.block_size, hashes, cache_salt)
        return len(self._longest_cached_chain(hashes)) * self.block_size

    def _longest_cached_chain(self, block_hashes: list) -> list[KVCacheBlock]:
        """Cached blocks matching the keys in order, each computed right after the previous one."""
        hits: list[KVCacheBlock] = []
        for block_hash in block_hashes:
            block = self.pool.get_cached_block(self._key(block_hash))
            if block is None or not block.follows(hits[-1] if hits else None):
                break
            hits.append(block)
        return hits

    # ---- allocation ------------------------------------------------------------------------
    def allocate_slots(self, request: Request, num_new_tokens: int,
                       new_computed_blocks: list[KVCacheBlock] | None = None,
                       num_new_computed_tokens: int = 0) -> list[KVCacheBlock] | None:
        """Make room for `num_new_tokens` more tokens after the computed ones (plus prefix hits).

        A block the new tokens land in that other requests still share (after a fork), or that is
        published in the prefix cache, is copied first: shared and cached KV never changes.
        Under a sliding window, the blocks no query from this step on reads are freed first (they
        are freed even if the step does not fit), and prefix hits outside the window are not taken.
        Returns the newly allocated blocks, or None, changing nothing else, when the pool is short."""
        plan = self.plan_slots(request, num_new_tokens, new_computed_blocks, num_new_computed_tokens)
        if plan.blocks_needed > self.pool.num_free_blocks:
            self.cancel_slots(request, plan)
            return None
        return self.commit_slots(request, plan)

    def plan_slots(self, request: Request, num_new_tokens: int, new_computed_blocks: list[KVCacheBlock] | None,
                   num_new_computed_tokens: int) -> SlotPlan:
        """allocate_slots' first half: frees what left the window (or the drop budget) and works out
        what the step takes; nothing is taken yet."""
        req_blocks = self.req_to_blocks.setdefault(request.request_id, [])
        num_computed = request.num_computed_tokens + num_new_computed_tokens
        self._free_outside_window(request, req_blocks, num_computed)
        self._drop_low_mass_blocks(request.request_id, req_blocks, num_computed)
        hits = self._hits_in_window(new_computed_blocks or [], len(req_blocks), num_computed)
        num_required = cdiv(num_computed + num_new_tokens, self.block_size)
        to_copy = [i for i in range(num_computed // self.block_size, len(req_blocks))
                   if req_blocks[i].ref_cnt > 1 or req_blocks[i].block_hash is not None]
        return SlotPlan(req_blocks, num_new_computed_tokens,
                        num_computed + num_new_tokens, hits, [b for b in hits if isinstance(b, KVCacheBlock)],
                        max(num_required - len(req_blocks) - len(hits), 0), to_copy)

    def cancel_slots(self, request: Request, plan: SlotPlan) -> None:
        """The pool is short: a request that held nothing before holds nothing after."""
        if not plan.req_blocks:
            self.req_to_blocks.pop(request.request_id, None)

    def commit_slots(self, request: Request, plan: SlotPlan) -> list[KVCacheBlock]:
        """allocate_slots' second half: take the hits, the copies and the new blocks (they fit)."""
        req_blocks = plan.req_blocks
        if not req_blocks:
            self._record_prefix_lookup(request, plan.num_new_computed_tokens)
        if plan.to_copy:
            self._copy_on_write(request.request_id, req_blocks, plan.to_copy)
        self.pool.touch(plan.live_hits)
        req_blocks.extend(plan.hits)
        new_blocks = self.pool.get_new_blocks(plan.num_new_blocks)
        req_blocks.extend(new_blocks)
        self._cache_full_blocks(request, plan.num_tokens_after)
        return new_blocks

    # ---- sliding window --------------------------------------------------------------------
    def _outside_window(self, num_computed: int) -> range:
        """Table indices no query at a position >= num_computed reads: past the sink blocks and
        wholly before the window's first key, num_computed - W + 1."""
        if self.sliding_window is None:
            return range(0)
        first_key = max(num_computed - self.sliding_window + 1, 0)
        return range(self._num_sink_blocks, first_key // self.block_size)

    def _free_outside_window(self, request: Request, req_blocks: list[TableEntry], num_computed: int) -> None:
        """Give back the request's blocks that fell out of the window, tail first into the LRU queue.

        Freed entries form one run from the sink blocks up, so the scan stops at the first entry
        freed before. Blocks are published first: an entry's lineage is fixed as it leaves."""
        outside = self._outside_window(num_computed)
        stop = min(outside.stop, len(req_blocks))
        if stop <= outside.start or isinstance(req_blocks[stop - 1], FreedBlock):
            return
        self._cache_full_blocks(request, num_computed)
        freed: list[KVCacheBlock] = []
        for i in range(stop - 1, outside.start - 1, -1):
            block = req_blocks[i]
            if isinstance(block, FreedBlock):
                break
            lineage = self._lineage(request, i)
            req_blocks[i] = FreedBlock(lineage.block_id, lineage.generation)
            freed.append(block)
        self.pool.free_blocks(freed)

    def _hits_in_window(self, hits: list[KVCacheBlock], first_index: int, num_computed: int) -> list[TableEntry]:
        """Prefix hits as table entries from `first_index` on: a hit outside the window is not
        taken (a published block is its own lineage), so it stays free and costs nothing."""
        outside = self._outside_window(num_computed)
        return [FreedBlock(b.block_id, b.generation) if first_index + k in outside else b
                for k, b in enumerate(hits)]

    # ---- score-based dropping ---------------------------------------------------------------
    def _drop_low_mass_blocks(self, request_id: str, req_blocks: list[TableEntry], num_computed: int) -> None:
        """The score drop policy: give back the blocks beyond the request's budget that attention
        used least (score_dropping.blocks_to_drop); their entries become DROPPED, which the runner
        masks for every later query."""
        if self.drop_budget is None or len(req_blocks) < cdiv(num_computed, self.block_size):
            return
        live = [isinstance(b, KVCacheBlock) for b in req_blocks]
        drop = blocks_to_drop(self._block_mass.get(request_id, []), live, num_computed, self.block_size,
                              self.drop_budget)
        if not drop:
            return
        self.pool.free_blocks([req_blocks[i] for i in reversed(drop)])  # type: ignore[misc]
        for i in drop:
            req_blocks[i] = FreedBlock(DROPPED_BLOCK_ID, 0)
        self._dropped.setdefault(request_id, []).extend(drop)

    def add_block_mass(self, request_id: str, mass: list[float]) -> None:
        """Add a step's attention mass per block index (ModelRunnerOutput.kv_block_mass)."""
        if request_id not in self.req_to_blocks:  # ended or preempted while the step ran
            return
        acc = self._block_mass.setdefault(request_id, [])
        acc.extend([0.0] * (len(mass) - len(acc)))
        for i, m in enumerate(mass):
            acc[i] += m

    def take_dropped(self, request_id: str) -> list[int]:
        """Table indices of the request dropped since the last call (the runner marks them -1)."""
        return self._dropped.pop(request_id, [])

    # ---- publishing ------------------------------------------------------------------------
    def _cache_full_blocks(self, request: Request, num_tokens_after_step: int) -> None:
        """Publish blocks that are full once this step's tokens are written. Freed entries were
        published (or could not be) before they were freed."""
        if not self.enable_caching:
            return
        req_id = request.request_id
        blocks = self.req_to_blocks[req_id]
        num_full = min(min(num_tokens_after_step, request.num_tokens) // self.block_size, len(blocks))
        start = self._num_cached_blocks.get(req_id, 0)
        if num_full <= start:
            return
        self._update_hashes(request)
        for i in range(start, num_full):
            block = blocks[i]
            if isinstance(block, KVCacheBlock):
                self.pool.cache_block(block, self._key(request.block_hashes[i]),
                                      self._lineage(request, i - 1) if i else None,
                                      request.block_hashes[i - 1] if i else None)
        self._num_cached_blocks[req_id] = num_full

    def _lineage(self, request: Request, index: int) -> KVCacheBlock | FreedBlock:
        """What the request's block `index` counts as when a later block is published after it: a
        freed entry's recorded lineage, else the block or its published equivalent."""
        block = self.req_to_blocks[request.request_id][index]
        if isinstance(block, FreedBlock) or not self.enable_caching or index >= len(request.block_hashes):
            return block
        return self._published_equivalent(block, request.block_hashes[index])

    def _published_equivalent(self, block: KVCacheBlock, block_hash) -> KVCacheBlock:
        """`block` if it is published, else the published block under the same key computed after
        the same parent (so it holds the same KV), if any. A request that computed a block someone
        else published first thus still extends the published chain."""
        if block.block_hash is not None:
            return block
        published = self.pool.get_cached_block(self._key(block_hash))
        if published is not None and published.parent == block.parent:
            return published
        return block

    # ---- fork and copy-on-write --------------------------------------------------------------
    def fork(self, parent: Request, child: Request) -> None:
        """Let `child` share `parent`'s computed blocks by reference count (n > 1, beam search).

        The child's tokens must equal the parent's over the shared range. It starts with
        num_computed_tokens = min(parent's, its own num_tokens - 1): at least one token is left to
        compute, so logits exist. A shared block it (or the parent) later writes into is copied
        first, by allocate_slots; the last holder writes in place.

            parent: [ b3 | b8 | b1 ]     b1 partial (tokens 32..37 computed); refs 2, 2, 2 after fork
            child:  [ b3 | b8 | b1 ]
            the child writes token 38 -> b1 is shared -> copy b1 to b6:  child [ b3 | b8 | b6 ]
        """
        assert child.request_id not in self.req_to_blocks, f"{child.request_id} already holds blocks"
        num_computed = min(parent.num_computed_tokens, child.num_tokens - 1)
        assert child.all_token_ids[:num_computed] == parent.all_token_ids[:num_computed]
        num_shared = cdiv(num_computed, self.block_size)
        parent_blocks = self.req_to_blocks.get(parent.request_id, [])
        assert len(parent_blocks) >= num_shared, (len(parent_blocks), num_shared)
        shared = parent_blocks[:num_shared]
        needed = range(max(self._outside_window(num_computed).stop, self._num_sink_blocks), num_shared)
        # The parent freed only what no query at or after its own step start reads, and a child
        # starts there or later: whatever the child still reads is live.
        assert all(isinstance(shared[i], KVCacheBlock) or shared[i].block_id == DROPPED_BLOCK_ID
                   for i in needed), "fork needs a freed block"
        self.pool.touch(b for b in shared if isinstance(b, KVCacheBlock))
        self.req_to_blocks[child.request_id] = list(shared)
        if parent.request_id in self._block_mass:  # the child's attention history is the parent's
            self._block_mass[child.request_id] = list(self._block_mass[parent.request_id])
        child.num_computed_tokens = num_computed
        num_full = num_computed // self.block_size
        child.block_hashes = list(parent.block_hashes[:num_full])
        self._num_cached_blocks[child.request_id] = min(
            self._num_cached_blocks.get(parent.request_id, 0), num_full)

    def _copy_on_write(self, request_id: str, req_blocks: list[TableEntry], indices: list[int]) -> None:
        for i in indices:
            src = req_blocks[i]
            dst = self.pool.get_new_blocks(1)[0]
            self.pool.free_blocks([src])  # its other holders keep it
            dst.parent = src.parent  # same KV, same lineage
            req_blocks[i] = dst
            self._block_copies.append((src.block_id, dst.block_id))
        self._rewritten_req_ids.add(request_id)

    def take_block_copies(self) -> tuple[list[tuple[int, int]], set[str]]:
        """(src, dst) block copies the runner must make before the next forward, and the requests
        whose block table changed other than by appending; both cleared."""
        copies, rewritten = self._block_copies, self._rewritten_req_ids
        self._block_copies, self._rewritten_req_ids = [], set()
        return copies, rewritten

    def free(self, request: Request) -> None:
        """Release the request's blocks; the tail goes first into the LRU queue, since a shared
        prefix's head is the part most likely to be hit again."""
        blocks = self.req_to_blocks.pop(request.request_id, [])
        self._num_cached_blocks.pop(request.request_id, None)
        self._block_mass.pop(request.request_id, None)
        self._dropped.pop(request.request_id, None)
        self.pool.free_blocks(reversed([b for b in blocks if isinstance(b, KVCacheBlock)]))

    def reset_prefix_cache(self) -> bool:
        return self.pool.reset_prefix_cache()

    def check_integrity(self) -> None:
        """Pool invariants, plus: each block's ref count equals the number of live tables holding
        it, and freed entries are one run past the sink blocks."""
        self.pool.check_integrity()
        holders: dict[int, int] = {}
        self.count_holders(holders)
        for block in self.pool.blocks:
            assert block.ref_cnt == holders.get(block.block_id, 0), (block, holders.get(block.block_id))

    def count_holders(self, holders: dict[int, int]) -> None:
        """Add, per block id, the live tables of this manager holding it (checking each table's
        freed run on the way)."""
        for blocks in self.req_to_blocks.values():
            freed = [i for i, b in enumerate(blocks) if isinstance(b, FreedBlock) and b.block_id != DROPPED_BLOCK_ID]
            assert freed == list(range(self._num_sink_blocks, self._num_sink_blocks + len(freed))), freed
            for b in blocks:
                if isinstance(b, KVCacheBlock):
                    holders[b.block_id] = holders.get(b.block_id, 0) + 1


def _needs_whole_prompt(request: Request) -> bool:
    """Prompt logprobs of every position: the whole prompt is computed, none of it cached. So is a
    preempted request's that wants any: it resends only positions past those it sent, which holds
    when it starts again from the first token, but not from a cache hit beyond them."""
    params = request.sampling_params
    if params.prompt_logprobs is None:
        return False
    return params.prompt_logprobs_start is None or request.num_preemptions > 0
