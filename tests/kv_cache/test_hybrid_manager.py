"""Layer groups (kv_cache/hybrid.py) at the manager level: how layers are grouped, that each group
keeps its own table from the one pool (full groups keep everything, windowed groups free what
their window left), that an allocation is all-or-nothing across groups, and that prefix hits
count only what every group has cached."""

from __future__ import annotations

import pytest

from kvtide.engine.request import EngineCoreRequest, Request
from kvtide.kv_cache.block_pool import KVCacheBlock
from kvtide.kv_cache.hybrid import HybridKVCacheManager, KVCacheGroup, blocks_held, plan_kv_cache_groups
from kvtide.kv_cache.manager import cdiv
from kvtide.sampling_params import SamplingParams

BS = 4
WINDOW = 6
GROUPS = (KVCacheGroup(None, (0, 1)), KVCacheGroup(WINDOW, (2, 3)))


def _request(rid: str, tokens: list[int]) -> Request:
    return Request(EngineCoreRequest(rid, tokens, SamplingParams(max_tokens=1000)))


def _step(mgr: HybridKVCacheManager, req: Request, n: int) -> list[KVCacheBlock]:
    new = mgr.allocate_slots(req, n)
    assert new is not None
    req.num_computed_tokens += n
    if req.num_computed_tokens == req.num_tokens:
        req.append_output_token(7)
    return new


@pytest.mark.parametrize(("windows", "expected"), [
    ([None, None, 16, 16], [(None, (0, 1)), (16, (2, 3))]),
    ([None, 8, None, 8], [(None, (0, 2)), (8, (1, 3))]),
    ([16, 16, None, 16, 16, 16], [(None, (2,)), (16, (0,)), (16, (1,)), (16, (3,)), (16, (4,)), (16, (5,))]),
    ([None] * 2 + [4] * 4, [(None, (0, 1)), (4, (2, 3)), (4, (4, 5))]),
    ([None, 8, 16, None], [(None, (0,)), (None, (3,)), (8, (1,)), (16, (2,))]),  # each window is a kind
    ([None] * 5 + [4] * 3, [(None, (i,)) for i in range(5)] + [(4, (i,)) for i in range(5, 8)]),
])
def test_layers_are_grouped_by_kind_into_equal_groups(windows, expected):
    groups = plan_kv_cache_groups(windows)
    assert [(g.window, g.layers) for g in groups] == expected


def test_one_kind_of_layer_needs_no_groups():
    assert plan_kv_cache_groups([None] * 4) is None
    assert plan_kv_cache_groups([16] * 4) is None


def test_each_group_has_its_table_and_the_windowed_one_frees():
    mgr = HybridKVCacheManager(GROUPS, num_blocks=64, block_size=BS)
    req = _request("r", list(range(10)))
    _step(mgr, req, 10)
    for _ in range(30):  # 40 tokens computed
        _step(mgr, req, 1)
    full, win = mgr.managers
    assert len(full.req_to_blocks["r"]) == len(win.req_to_blocks["r"]) == cdiv(40, BS)
    assert full.num_live_blocks("r") == cdiv(40, BS)
    # The window table holds only what the last query (at 39: keys 34..39) read.
    assert win.num_live_blocks("r") <= cdiv(WINDOW, BS) + 2
    assert mgr.num_live_blocks("r") == mgr.pool.num_used_blocks
    flat = mgr.get_block_ids("r")
    assert flat[0::2] == full.get_block_ids("r") and flat[1::2] == win.get_block_ids("r")
    # No block is in two tables; every reference is accounted for.
    live = [b.block_id for m in mgr.managers for b in m.req_to_blocks["r"] if isinstance(b, KVCacheBlock)]
    assert len(live) == len(set(live))
    mgr.check_integrity()
    mgr.free(req)
    assert mgr.pool.num_used_blocks == 0
    mgr.check_integrity()


def test_allocation_is_all_or_nothing_across_groups():
    mgr = HybridKVCacheManager(GROUPS, num_blocks=5, block_size=BS)
    big = _request("big", list(range(12)))  # 3 blocks per group = 6 > 5
    assert mgr.allocate_slots(big, 12) is None
    assert mgr.pool.num_used_blocks == 0 and "big" not in mgr.req_to_blocks
    assert all("big" not in m.req_to_blocks for m in mgr.managers)
    small = _request("small", list(range(8)))
    new = _step(mgr, small, 8)
    assert len(new) == 4 and mgr.pool.num_used_blocks == 4
    # The next block needs one per group (2), only 1 is free: nothing is taken.
    small_more = mgr.allocate_slots(small, 1)
    assert small_more is None and mgr.pool.num_used_blocks == 4
    mgr.check_integrity()


def test_prefix_hits_are_what_every_group_has_cached():
    mgr = HybridKVCacheManager(GROUPS, num_blocks=64, block_size=BS)
    tokens = list(range(20))
    first = _request("a", tokens)
    _step(mgr, first, 20)
    second = _request("b", tokens + [99])
    hits, num_tokens = mgr.get_computed_blocks(second)
    assert num_tokens == 20 and [len(h) for h in hits] == [5, 5]
    # Evict the windowed group's first cached block: the full group alone still has the whole chain,
    # but a hit needs every group's KV, so there is none.
    mgr.free(first)
    win_first = mgr.pool.get_cached_block((1, second.block_hashes[0]))
    full_first = mgr.pool.get_cached_block(second.block_hashes[0])
    # The same tokens, published by each group under its own key: two blocks, never shared.
    assert win_first is not None and full_first is not None and win_first is not full_first
    assert win_first.ref_cnt == 0
    mgr.pool._evict(win_first)
    assert mgr.managers[0].get_computed_blocks(second)[1] == 20
    assert mgr.get_computed_blocks(second) == ([[], []], 0)


def test_blocks_held_sums_the_groups():
    # A 1,000-token request, 32-token steps: 250 full blocks, the window's at most cdiv(6 + 32 + 2, 4).
    assert blocks_held(GROUPS, 1000, 32, BS) == 250 + cdiv(WINDOW + 32 + BS - 2, BS)
    mgr = HybridKVCacheManager(GROUPS, num_blocks=512, block_size=BS)
    assert mgr.max_blocks_held(1000, 32) == blocks_held(GROUPS, 1000, 32, BS)
