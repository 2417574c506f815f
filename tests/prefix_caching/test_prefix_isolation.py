"""Prefix-cache safety: forged hashes cannot corrupt output, salts isolate tenants, eviction never
takes a block in use, and the accounting users see (cached tokens, in-use vs evictable blocks,
the radix view, reset) tells the truth."""

from __future__ import annotations

import random

import pytest
from prefix_helpers import BLOCK_SIZE, assert_drained, greedy, make_llm, random_tokens, tokens_of

from kvtide.kv_cache.block_pool import BlockPool


def test_forged_constant_hash_cannot_corrupt_output(llama_dir):
    """With every digest equal, keys still carry each block's tokens, and a hit must continue the
    physical chain it matched so far: Y = [A, D] must not reuse D's block computed after C."""
    rng = random.Random(1)
    a, b, c, d = (random_tokens(rng, BLOCK_SIZE) for _ in range(4))
    tail = random_tokens(rng, 5)
    x, z, y = a + b + tail, c + d + tail, a + d + tail
    reference = tokens_of(make_llm(llama_dir, enable_prefix_caching=False).generate([y], greedy(8)))

    llm = make_llm(llama_dir)
    manager = llm.engine.core.scheduler.kv_cache_manager
    manager.hash_fn = lambda data: b"\x00" * 32
    llm.generate([x], greedy(2))
    llm.generate([z], greedy(2))
    out = llm.generate([y], greedy(8))[0]
    assert tokens_of([out]) == reference
    assert out.num_cached_tokens == BLOCK_SIZE  # A only: D's cached block follows C, not A
    # The same prompt again hits its own chain in full.
    again = llm.generate([y], greedy(8))[0]
    assert tokens_of([again]) == reference and again.num_cached_tokens == 2 * BLOCK_SIZE
    assert_drained(llm)


def test_cache_salt_isolates_tenants(llama_dir):
    prompt = random_tokens(random.Random(2), 3 * BLOCK_SIZE + 1)
    llm = make_llm(llama_dir)
    first = llm.generate([prompt], greedy(2, cache_salt="tenant-a"))[0]
    other = llm.generate([prompt], greedy(2, cache_salt="tenant-b"))[0]
    unsalted = llm.generate([prompt], greedy(2))[0]
    same = llm.generate([prompt], greedy(2, cache_salt="tenant-a"))[0]
    assert (first.num_cached_tokens, other.num_cached_tokens, unsalted.num_cached_tokens) == (0, 0, 0)
    assert same.num_cached_tokens == 3 * BLOCK_SIZE
    assert tokens_of([first]) == tokens_of([other]) == tokens_of([unsalted]) == tokens_of([same])
    # The radix view honours the salt too.
    manager = llm.engine.core.scheduler.kv_cache_manager
    assert manager.num_cached_prefix_tokens(prompt, "tenant-a") == 3 * BLOCK_SIZE
    assert manager.num_cached_prefix_tokens(prompt, "tenant-c") == 0


def test_eviction_under_pressure_never_takes_a_block_in_use(llama_dir, monkeypatch):
    """A 24-block cache under 12 requests with shared and private prefixes: every eviction takes
    a free block, the LRU evicts, and after the drain free + evictable == total."""
    rng = random.Random(3)
    shared = random_tokens(rng, 3 * BLOCK_SIZE)
    bytes_per_block = 2 * BLOCK_SIZE * 2 * 32 * 4 * 4
    llm = make_llm(llama_dir, kv_cache_memory=str(24 * bytes_per_block), max_model_len=256)
    manager = llm.engine.core.scheduler.kv_cache_manager
    evicted = []
    original = BlockPool._evict

    def checked_evict(self, block):
        if block.block_hash is not None:
            assert block.ref_cnt == 0, block
            assert all(block not in blocks for blocks in manager.req_to_blocks.values()), block
            evicted.append(block.block_id)
        original(self, block)

    monkeypatch.setattr(BlockPool, "_evict", checked_evict)
    for _ in range(2):
        prompts = [shared + random_tokens(rng, 20) if i % 2 else random_tokens(rng, 60) for i in range(12)]
        outputs = llm.generate(prompts, greedy(4))
        assert len(outputs) == 12
        assert_drained(llm)
    assert evicted, "the workload was meant to evict"
    stats = llm.engine.core.get_stats()
    assert stats.num_evictable_blocks > 0 and stats.num_used_blocks == 0


def test_get_new_blocks_only_pops_free_blocks():
    """Pool level: a held block is never in the free queue, so allocation cannot evict it."""
    pool = BlockPool(4)
    held = pool.get_new_blocks(2)
    pool.free_blocks([held[1]])
    got = pool.get_new_blocks(2)
    assert held[0] not in got and all(b.ref_cnt == 1 for b in got + held[:1])
    with pytest.raises(ValueError):
        pool.get_new_blocks(2)
    pool.check_integrity()


def test_in_use_and_evictable_are_reported_apart(llama_dir):
    prompt = random_tokens(random.Random(4), 4 * BLOCK_SIZE + 3)
    llm = make_llm(llama_dir)
    engine = llm.engine
    engine.add_request("r", prompt, greedy(3))
    engine.step()
    live = engine.core.get_stats()
    assert live.num_used_blocks == 5 and live.num_evictable_blocks == 0
    while engine.has_unfinished_requests():
        engine.step()
    idle = engine.core.get_stats()
    assert idle.num_used_blocks == 0 and idle.kv_cache_usage == 0.0
    assert idle.num_evictable_blocks == 4  # full blocks stay cached; the partial one is plain free
    assert idle.prefix_cache_queries == len(prompt) and idle.prefix_cache_hits == 0


def test_radix_view_and_reset(llama_dir):
    rng = random.Random(5)
    prompt = random_tokens(rng, 3 * BLOCK_SIZE + 2)
    llm = make_llm(llama_dir)
    manager = llm.engine.core.scheduler.kv_cache_manager
    assert manager.num_cached_prefix_tokens(prompt) == 0
    llm.generate([prompt], greedy(2))
    used_before = manager.pool.num_used_blocks
    assert manager.num_cached_prefix_tokens(prompt) == 3 * BLOCK_SIZE
    assert manager.num_cached_prefix_tokens(prompt[:2 * BLOCK_SIZE + 1]) == 2 * BLOCK_SIZE
    assert manager.num_cached_prefix_tokens(prompt[:5] + random_tokens(rng, 40)) == 0
    assert manager.pool.num_used_blocks == used_before  # the view allocates nothing
    assert llm.generate([prompt], greedy(2))[0].num_cached_tokens == 3 * BLOCK_SIZE
    assert llm.reset_prefix_cache() is True
    assert manager.num_cached_prefix_tokens(prompt) == 0
    assert llm.generate([prompt], greedy(2))[0].num_cached_tokens == 0
    # Refused while a request holds blocks.
    llm.engine.add_request("busy", prompt, greedy(3))
    llm.engine.step()
    assert llm.reset_prefix_cache() is False
    llm.engine.abort_request(["busy"])
    assert llm.reset_prefix_cache() is True
