"""BlockPool and prefix-cache keys: LRU order, eviction, cache hits, hash chain."""

from __future__ import annotations

import pytest

from kvtide.engine.request import EngineCoreRequest, Request
from kvtide.kv_cache.block_pool import BlockPool
from kvtide.kv_cache.manager import KVCacheManager
from kvtide.kv_cache.prefix_cache import HASH_FUNCTIONS, get_hash_fn, hash_block_tokens, hash_request_blocks
from kvtide.sampling_params import SamplingParams


def free_order(pool: BlockPool) -> list[int]:
    return list(pool._free)


def key(tokens: tuple[int, ...], parent=None, algo: str = "sha256"):
    return hash_block_tokens(get_hash_fn(algo), parent, tokens)


def make_request(request_id: str, tokens: list[int], **params) -> Request:
    return Request(EngineCoreRequest(request_id, tokens, SamplingParams(**params)))


# ---- LRU free queue ----------------------------------------------------------------------------

def test_fresh_pool_hands_out_blocks_in_id_order():
    pool = BlockPool(6)
    assert [b.block_id for b in pool.get_new_blocks(3)] == [0, 1, 2]
    assert free_order(pool) == [3, 4, 5]
    assert all(b.ref_cnt == 1 for b in pool.blocks[:3])
    pool.check_integrity()


def test_freed_blocks_join_the_tail_in_the_given_order():
    pool = BlockPool(5)
    a = pool.get_new_blocks(2)  # 0, 1
    b = pool.get_new_blocks(2)  # 2, 3
    pool.free_blocks(reversed(a))
    assert free_order(pool) == [4, 1, 0]
    pool.free_blocks(b)
    assert free_order(pool) == [4, 1, 0, 2, 3]
    # Reuse takes the least recently freed first.
    assert [blk.block_id for blk in pool.get_new_blocks(3)] == [4, 1, 0]
    pool.check_integrity()


def test_shared_block_joins_the_queue_only_when_its_last_reference_drops():
    pool = BlockPool(3)
    (blk,) = pool.get_new_blocks(1)
    pool.touch([blk])
    assert blk.ref_cnt == 2
    pool.free_blocks([blk])
    assert blk.ref_cnt == 1 and blk.block_id not in pool._free
    pool.check_integrity()
    pool.free_blocks([blk])
    assert blk.ref_cnt == 0 and free_order(pool)[-1] == blk.block_id
    pool.check_integrity()


def test_double_free_is_caught():
    pool = BlockPool(2)
    (blk,) = pool.get_new_blocks(1)
    pool.free_blocks([blk])
    with pytest.raises(AssertionError):
        pool.free_blocks([blk])


def test_allocating_more_than_free_raises_and_changes_nothing():
    pool = BlockPool(3)
    pool.get_new_blocks(2)
    before = (free_order(pool), [b.ref_cnt for b in pool.blocks])
    with pytest.raises(ValueError):
        pool.get_new_blocks(2)
    assert (free_order(pool), [b.ref_cnt for b in pool.blocks]) == before


# ---- eviction ------------------------------------------------------------------------------------

def test_only_free_blocks_are_evicted_and_lru_first():
    pool = BlockPool(4)
    blocks = pool.get_new_blocks(4)
    keys = [key((i, i)) for i in range(4)]
    for blk, k in zip(blocks, keys, strict=True):
        pool.cache_block(blk, k)
    # Free 2 then 0: these two are the only evictable blocks, 2 first.
    pool.free_blocks([blocks[2], blocks[0]])
    assert pool.num_evictable_blocks == 2
    (got,) = pool.get_new_blocks(1)
    assert got is blocks[2]
    assert got.block_hash is None and pool.get_cached_block(keys[2]) is None
    assert pool.num_evictions == 1
    # The in-use blocks keep their keys.
    assert pool.get_cached_block(keys[1]) is blocks[1]
    assert pool.get_cached_block(keys[3]) is blocks[3]
    assert pool.get_cached_block(keys[0]) is blocks[0]
    (got,) = pool.get_new_blocks(1)
    assert got is blocks[0]
    with pytest.raises(ValueError):
        pool.get_new_blocks(1)  # the rest are in use: never evicted
    assert pool.get_cached_block(keys[1]) is blocks[1]
    pool.check_integrity()


def test_evicting_an_uncached_block_counts_nothing():
    pool = BlockPool(2)
    pool.get_new_blocks(2)
    assert pool.num_evictions == 0


# ---- cache hits ----------------------------------------------------------------------------------

def test_cached_free_block_hit_leaves_the_free_queue():
    pool = BlockPool(4)
    blocks = pool.get_new_blocks(2)
    k = key((1, 2))
    pool.cache_block(blocks[0], k)
    pool.free_blocks(reversed(blocks))
    assert free_order(pool) == [2, 3, 1, 0]
    hit = pool.get_cached_block(k)
    assert hit is blocks[0]
    pool.touch([hit])
    assert hit.ref_cnt == 1 and hit.block_id not in pool._free
    assert free_order(pool) == [2, 3, 1]
    # Allocating everything else never hands out the hit block.
    assert hit not in pool.get_new_blocks(3)
    assert pool.get_cached_block(k) is hit
    pool.check_integrity()


def test_cache_block_keeps_the_first_block_published_under_a_key():
    pool = BlockPool(3)
    a, b = pool.get_new_blocks(2)
    k = key((5, 5))
    pool.cache_block(a, k)
    pool.cache_block(b, k)
    assert pool.get_cached_block(k) is a and b.block_hash is None
    # Evicting b (never published) must not drop a's entry.
    pool.free_blocks([b])
    pool.get_new_blocks(2)
    assert pool.get_cached_block(k) is a
    pool.check_integrity()


def test_caching_disabled_publishes_nothing():
    pool = BlockPool(2, enable_caching=False)
    (blk,) = pool.get_new_blocks(1)
    pool.cache_block(blk, key((1,)))
    assert blk.block_hash is None and pool.get_cached_block(key((1,))) is None


# ---- reset ---------------------------------------------------------------------------------------

def test_reset_prefix_cache_refused_while_blocks_are_in_use():
    pool = BlockPool(3)
    blocks = pool.get_new_blocks(2)
    k0, k1 = key((0,)), key((1,))
    pool.cache_block(blocks[0], k0)
    pool.cache_block(blocks[1], k1)
    pool.free_blocks([blocks[0]])
    assert pool.reset_prefix_cache() is False
    assert pool.get_cached_block(k0) is blocks[0] and pool.get_cached_block(k1) is blocks[1]
    pool.free_blocks([blocks[1]])
    assert pool.reset_prefix_cache() is True
    assert pool.get_cached_block(k0) is None and pool.get_cached_block(k1) is None
    assert pool.num_evictable_blocks == 0 and pool.num_free_blocks == 3
    pool.check_integrity()


def test_manager_reset_refused_while_a_request_holds_blocks():
    mgr = KVCacheManager(num_blocks=4, block_size=2)
    req = make_request("a", [1, 2, 3])
    assert mgr.allocate_slots(req, 3) is not None
    assert mgr.reset_prefix_cache() is False
    mgr.free(req)
    assert mgr.reset_prefix_cache() is True
    mgr.check_integrity()


# ---- hash chain ----------------------------------------------------------------------------------

@pytest.mark.parametrize("algo", sorted(HASH_FUNCTIONS))
def test_same_tokens_under_different_parents_get_different_keys(algo):
    fn = get_hash_fn(algo)
    parent_a = hash_block_tokens(fn, None, (1, 2))
    parent_b = hash_block_tokens(fn, None, (3, 4))
    child_a = hash_block_tokens(fn, parent_a, (7, 8))
    child_b = hash_block_tokens(fn, parent_b, (7, 8))
    assert child_a != child_b
    assert child_a.hash_value != child_b.hash_value
    assert child_a.token_ids == child_b.token_ids == (7, 8)
    # Deterministic: same inputs, same key.
    assert hash_block_tokens(fn, parent_a, (7, 8)) == child_a


@pytest.mark.parametrize("algo", sorted(HASH_FUNCTIONS))
def test_cache_salt_changes_only_the_first_block_key_directly(algo):
    fn = get_hash_fn(algo)
    tokens = list(range(8))
    plain: list = []
    salted: list = []
    other: list = []
    hash_request_blocks(fn, tokens, 4, plain)
    hash_request_blocks(fn, tokens, 4, salted, cache_salt="tenant-a")
    hash_request_blocks(fn, tokens, 4, other, cache_salt="tenant-b")
    assert len(plain) == len(salted) == 2
    assert plain[0] != salted[0] != other[0] != plain[0]
    # The salt reaches later blocks through the chain.
    assert plain[1] != salted[1]
    assert salted[1] == hash_block_tokens(fn, salted[0], tokens[4:8])


def test_salted_requests_never_share_blocks():
    mgr = KVCacheManager(num_blocks=8, block_size=4)
    tokens = list(range(9))
    a = make_request("a", tokens, cache_salt="x")
    assert mgr.allocate_slots(a, 9) is not None
    a.num_computed_tokens = 9
    b = make_request("b", tokens, cache_salt="y")
    assert mgr.get_computed_blocks(b) == ([], 0)
    c = make_request("c", tokens, cache_salt="x")
    hits, n = mgr.get_computed_blocks(c)
    assert n == 8 and hits == mgr.req_to_blocks["a"][:2]


@pytest.mark.parametrize("algo", sorted(HASH_FUNCTIONS))
def test_both_hash_algorithms_drive_prefix_hits(algo):
    mgr = KVCacheManager(num_blocks=8, block_size=4, hash_algo=algo)
    tokens = list(range(10))
    a = make_request("a", tokens)
    assert mgr.allocate_slots(a, 10) is not None
    a.num_computed_tokens = 10
    b = make_request("b", tokens[:8] + [99, 98, 97])
    hits, n = mgr.get_computed_blocks(b)
    assert n == 8 and [h.block_id for h in hits] == mgr.get_block_ids("a")[:2]
    assert mgr.num_cached_prefix_tokens(tokens) == 8
    assert len(a.block_hashes[0].hash_value) == (32 if algo == "sha256" else 16)


def test_unknown_hash_algo_is_a_value_error():
    with pytest.raises(ValueError, match="sha256"):
        get_hash_fn("md5")
    with pytest.raises(ValueError):
        KVCacheManager(num_blocks=4, block_size=4, hash_algo="python-hash")


def test_key_includes_token_ids_so_a_digest_collision_cannot_match():
    fn = get_hash_fn("sha256")
    k1 = hash_block_tokens(fn, None, (1, 2))
    forged = type(k1)(k1.hash_value, (9, 9))
    pool = BlockPool(2)
    (blk,) = pool.get_new_blocks(1)
    pool.cache_block(blk, k1)
    assert pool.get_cached_block(forged) is None


def test_prefix_hit_leaves_at_least_one_token_to_compute():
    mgr = KVCacheManager(num_blocks=8, block_size=4)
    tokens = list(range(8))
    a = make_request("a", tokens)
    assert mgr.allocate_slots(a, 8) is not None
    b = make_request("b", tokens)
    hits, n = mgr.get_computed_blocks(b)
    assert n == 4 and len(hits) == 1
