"""Per-layer-type block tables for models that mix full and sliding-window attention layers
(Qwen2's max_window_layers, Gemma-style alternation): vLLM's hybrid allocator idea.

With one table per request, a single full-attention layer keeps every block alive, so the windowed
layers' KV can never be freed. Here the layers are split into groups of S layers of one kind; each
request holds one table per group, all drawn from one pool whose block is S layers' worth of KV:

    layers:  0 full | 1 full | 2 win | 3 win             S = 2, groups: (0, 1) full, (2, 3) window
    cache:   slot tensor 0 serves layers 0 and 2, slot tensor 1 layers 1 and 3
    request: full table [ b3 | b8 | b1 | b4 ]  window table [ freed | freed | b6 | b2 ]

A block id belongs to one group at a time, so the layers of different groups that share a slot
tensor never meet in a block. The windowed groups give back what their window no longer reads (the
single-table manager's freeing, per group); a long request holds O(length) blocks for the full
layers and O(window) for the windowed ones.

The runner sees one flat table per request, the groups' entries interleaved (entry i * G + g is
group g's block for positions i * block_size ..), and each attention layer reads its group's
columns (AttentionMetadata.groups). Every rank of a replica gets the same flat tables; a pipeline
stage binds slot tensors for its own layers only (stage_slots), so its block may hold fewer layers.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvtide.engine.request import Request
from kvtide.kv_cache.block_pool import BlockPool, KVCacheBlock
from kvtide.kv_cache.manager import KVCacheManager, PrefixCacheStats, max_blocks_held


@dataclass(frozen=True)
class KVCacheGroup:
    """Layers sharing one block table: all full attention (window None) or all the same window."""

    window: int | None
    layers: tuple[int, ...]
    """Decoder layer indices; layer j of the group lives in slot tensor j."""


def plan_kv_cache_groups(windows: list[int | None]) -> tuple[KVCacheGroup, ...] | None:
    """Split layers by kind (full, or each distinct window) into groups of one size S, or None when
    every layer is of one kind (one table then frees as much as groups would).

    S is chosen to leave the fewest empty slots (a kind of n layers takes ceil(n / S) groups, the last
    padded), then the largest: 2 full + 2 windowed -> S = 2; 1 full + 5 windowed -> S = 1; 6 full + 30
    windowed (Gemma-3's 1:5) -> S = 6."""
    kinds: dict[int | None, list[int]] = {}
    for layer, window in enumerate(windows):
        kinds.setdefault(window, []).append(layer)
    if len(kinds) < 2:
        return None
    counts = [len(layers) for layers in kinds.values()]
    size = min(range(1, min(counts) + 1), key=lambda s: (sum(-(-n // s) * s for n in counts), -s))
    full_first = sorted(kinds.items(), key=lambda kv: (kv[0] is not None, kv[0] or 0))
    return tuple(KVCacheGroup(window, tuple(layers[i:i + size]))
                 for window, layers in full_first for i in range(0, len(layers), size))


def stage_slots(groups: tuple[KVCacheGroup, ...], layers: range) -> dict[int, tuple[int, int]]:
    """Decoder layer -> (group, slot tensor) for the layers one rank holds (a pipeline stage's
    `layers`). A group's layers on the stage take slots 0, 1, .. in order: layers of one group never
    share a slot, and a block belongs to one group at a time, so a stage needs only as many slot
    tensors as its largest share of one group (S at world size 1, where the slots are the layers'
    places in their groups)."""
    slots: dict[int, tuple[int, int]] = {}
    for g, group in enumerate(groups):
        for j, layer in enumerate(i for i in group.layers if i in layers):
            slots[layer] = (g, j)
    return slots


def num_slots(slots: dict[int, tuple[int, int]]) -> int:
    """Slot tensors a rank binds for its stage_slots."""
    return 1 + max(j for _, j in slots.values())


def blocks_held(groups: tuple[KVCacheGroup, ...], num_tokens: int, max_step_tokens: int, block_size: int) -> int:
    """The most pool blocks one request of `num_tokens` KV tokens holds at once, over all its tables."""
    return sum(max_blocks_held(num_tokens, max_step_tokens, block_size, g.window) for g in groups)


class HybridKVCacheManager:
    """KVCacheManager's interface over one manager per layer group sharing one BlockPool.

    Every group's table has the same length (a position's block exists in every group, or is a freed
    entry there), so the groups take the same number of new blocks each step and the flat table
    interleaves them. A prefix hit counts the blocks every group has cached along the chain."""

    def __init__(self, groups: tuple[KVCacheGroup, ...], num_blocks: int, block_size: int,
                 enable_caching: bool = True, hash_algo: str = "sha256") -> None:
        self.groups = groups
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.pool = BlockPool(num_blocks, enable_caching)
        self.managers = [KVCacheManager(num_blocks, block_size, enable_caching, hash_algo, sliding_window=g.window,
                                        pool=self.pool, group_id=i) for i, g in enumerate(groups)]
        self.sliding_window = None
        """No window covers every layer (the single-table manager's field, for its readers)."""

    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    @property
    def req_to_blocks(self) -> dict:
        """Group 0's tables: which requests hold blocks."""
        return self.managers[0].req_to_blocks

    @property
    def prefix_stats(self) -> PrefixCacheStats:
        """Group 0 counts the lookups (once per request, as one table would)."""
        return self.managers[0].prefix_stats

    @prefix_stats.setter
    def prefix_stats(self, stats: PrefixCacheStats) -> None:
        self.managers[0].prefix_stats = stats

    def usage(self) -> float:
        return self.pool.usage()

    def get_block_ids(self, request_id: str) -> list[int]:
        """The flat table: group g's entry for block i at i * G + g."""
        tables = [m.get_block_ids(request_id) for m in self.managers]
        return [block_id for entries in zip(*tables, strict=True) for block_id in entries]

    def num_live_blocks(self, request_id: str) -> int:
        return sum(m.num_live_blocks(request_id) for m in self.managers)

    def max_blocks_held(self, num_tokens: int, max_step_tokens: int) -> int:
        return blocks_held(self.groups, num_tokens, max_step_tokens, self.block_size)

    def num_cached_prefix_tokens(self, token_ids: list[int], cache_salt: str | None = None) -> int:
        return min(m.num_cached_prefix_tokens(token_ids, cache_salt) for m in self.managers)

    def get_computed_blocks(self, request: Request) -> tuple[list[list[KVCacheBlock]], int]:
        """Each group's hits, cut to the run all of them have, and its length in tokens."""
        per_group = [m.get_computed_blocks(request)[0] for m in self.managers]
        num_hit_blocks = min(len(hits) for hits in per_group)
        return [hits[:num_hit_blocks] for hits in per_group], num_hit_blocks * self.block_size

    def allocate_slots(self, request: Request, num_new_tokens: int,
                       new_computed_blocks: list[list[KVCacheBlock]] | None = None,
                       num_new_computed_tokens: int = 0) -> list[KVCacheBlock] | None:
        """KVCacheManager.allocate_slots for every group at once: all fit, or none takes anything.
        Returns the new blocks interleaved as in the flat table."""
        hits = new_computed_blocks or [[] for _ in self.managers]
        plans = [m.plan_slots(request, num_new_tokens, h, num_new_computed_tokens)
                 for m, h in zip(self.managers, hits, strict=True)]
        if sum(p.blocks_needed for p in plans) > self.pool.num_free_blocks:
            for m, p in zip(self.managers, plans, strict=True):
                m.cancel_slots(request, p)
            return None
        new = [m.commit_slots(request, p) for m, p in zip(self.managers, plans, strict=True)]
        return [block for blocks in zip(*new, strict=True) for block in blocks]

    def fork(self, parent: Request, child: Request) -> None:
        for m in self.managers:
            m.fork(parent, child)

    def take_block_copies(self) -> tuple[list[tuple[int, int]], set[str]]:
        copies: list[tuple[int, int]] = []
        rewritten: set[str] = set()
        for m in self.managers:
            c, r = m.take_block_copies()
            copies += c
            rewritten |= r
        return copies, rewritten

    def take_dropped(self, request_id: str) -> list[int]:
        """No drop policy runs under groups (engine_args keeps one table then)."""
        return []

    def add_block_mass(self, request_id: str, mass: list[float]) -> None:
        return None

    def free(self, request: Request) -> None:
        for m in self.managers:
            m.free(request)

    def reset_prefix_cache(self) -> bool:
        return self.pool.reset_prefix_cache()

    def check_integrity(self) -> None:
        """Pool invariants; each block's ref count equals the tables of all groups holding it (a
        block in two groups' tables would count twice and fail)."""
        self.pool.check_integrity()
        holders: dict[int, int] = {}
        for m in self.managers:
            m.count_holders(holders)
        for block in self.pool.blocks:
            assert block.ref_cnt == holders.get(block.block_id, 0), (block, holders.get(block.block_id))
        lengths = {tuple(len(m.req_to_blocks.get(r, ())) for m in self.managers) for r in self.req_to_blocks}
        assert all(len(set(ls)) == 1 for ls in lengths), lengths
