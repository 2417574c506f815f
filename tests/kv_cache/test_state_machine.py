"""A state machine over KVCacheManager: allocate / chunked prefill / decode / cache hit / free /
abort / preempt / resume / evict under pressure / reset, with the pool's invariants checked after
every step.

The model keeps its own view of what the pool should look like:

    tables[rid]   block ids a live request holds, in order (append-only while it lives)
    lru           the expected free queue, LRU first (freed tails go in first, hits leave it)
    kv[block]     the token id "written" at each slot, as a model runner would write K/V

so a cache hit can be checked against what was really written, not against the pool's own word.
Token ids come from a tiny alphabet so prefixes repeat and hits happen often.
"""

from __future__ import annotations

import os
import random
import time
from collections import OrderedDict

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from kvtide.engine.request import EngineCoreRequest, Request
from kvtide.kv_cache.manager import KVCacheManager, cdiv
from kvtide.sampling_params import SamplingParams

BLOCK_SIZE = 4
NUM_BLOCKS = 16
ALPHABET = st.integers(0, 2)
SALTS = st.sampled_from([None, None, None, "tenant"])


class KVCacheMachine:
    def __init__(self, num_blocks: int = NUM_BLOCKS, block_size: int = BLOCK_SIZE,
                 hash_algo: str = "sha256") -> None:
        self.bs = block_size
        self.mgr = KVCacheManager(num_blocks, block_size, enable_caching=True, hash_algo=hash_algo)
        self.live: dict[str, Request] = {}      # admitted: holds blocks, some tokens computed
        self.waiting: dict[str, Request] = {}   # failed admission or preempted: holds nothing
        self.tables: dict[str, list[int]] = {}
        self.lru: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        self.kv: dict[int, list[int | None]] = {i: [None] * block_size for i in range(num_blocks)}
        self.history: list[list[int]] = []
        self.counter = 0
        self.unique_token = 1000

    # ---- helpers ---------------------------------------------------------------------------
    def _snapshot(self):
        pool = self.mgr.pool
        return (list(pool._free), [(b.ref_cnt, b.block_hash) for b in pool.blocks],
                dict(pool._cached), {r: list(bs) for r, bs in self.mgr.req_to_blocks.items()},
                dict(self.mgr._num_cached_blocks), pool.num_evictions)

    def _new_id(self) -> str:
        self.counter += 1
        return f"r{self.counter}"

    def _allocate(self, req: Request, num_new: int, hits=None, num_hit_tokens: int = 0) -> bool:
        """allocate_slots, checked against the model: None changes nothing; otherwise the new
        blocks are the LRU head (after the hits leave the queue)."""
        before = self._snapshot()
        hits = hits or []
        new_blocks = self.mgr.allocate_slots(req, num_new, hits, num_hit_tokens)
        if new_blocks is None:
            assert self._snapshot() == before, "a failed allocation changed the pool"
            needed = cdiv(req.num_computed_tokens + num_hit_tokens + num_new, self.bs) \
                - len(self.tables.get(req.request_id, [])) - len(hits)
            hits_free = sum(1 for h in hits if h.block_id in self.lru)
            assert needed > len(self.lru) - hits_free, "allocation refused although blocks were free"
            return False
        for h in hits:
            self.lru.pop(h.block_id, None)
        expected = list(self.lru)[:len(new_blocks)]
        assert [b.block_id for b in new_blocks] == expected, "new blocks are not the LRU head"
        for b in new_blocks:
            del self.lru[b.block_id]
        table = self.tables.setdefault(req.request_id, [])
        table.extend(h.block_id for h in hits)
        table.extend(b.block_id for b in new_blocks)
        assert len(table) * self.bs >= req.num_computed_tokens + num_hit_tokens + num_new
        return True

    def _compute(self, req: Request, num_new: int, sample_token: int) -> None:
        """Write this step's tokens into their slots, then sample when the sequence is caught up."""
        table = self.tables[req.request_id]
        start = req.num_computed_tokens
        for pos in range(start, start + num_new):
            self.kv[table[pos // self.bs]][pos % self.bs] = req.all_token_ids[pos]
        req.num_computed_tokens += num_new
        if req.num_computed_tokens == req.num_tokens:
            req.append_output_token(sample_token)

    def _admit(self, req: Request, chunk: int, sample_token: int) -> None:
        hits, num_hit_tokens = self.mgr.get_computed_blocks(req)
        assert num_hit_tokens == len(hits) * self.bs < req.num_tokens
        for i, h in enumerate(hits):
            assert h.block_hash == req.block_hashes[i]
            assert self.kv[h.block_id] == req.all_token_ids[i * self.bs:(i + 1) * self.bs], \
                "a prefix hit points at a block holding other tokens"
        max_hit_blocks = (req.num_tokens - 1) // self.bs
        if len(hits) < max_hit_blocks:  # the longest run: the next block is not a usable hit
            nxt = self.mgr.pool.get_cached_block(req.block_hashes[len(hits)])
            if nxt is not None:  # a pool that checks chain continuity may refuse a key match
                follows = getattr(nxt, "follows", None)
                assert follows is not None and not follows(hits[-1] if hits else None), \
                    "the lookup stopped before a cached block that continues the chain"
        num_new = min(chunk, req.num_tokens - num_hit_tokens)
        if not self._allocate(req, num_new, hits, num_hit_tokens):
            self.waiting[req.request_id] = req
            return
        self.waiting.pop(req.request_id, None)
        req.num_computed_tokens = num_hit_tokens
        self.live[req.request_id] = req
        self._compute(req, num_new, sample_token)

    def _release(self, req: Request) -> None:
        """Free a live request; blocks whose last reference drops join the queue tail-first."""
        table = self.tables.pop(req.request_id, [])
        self.mgr.free(req)
        for block_id in reversed(table):
            if self.mgr.pool.blocks[block_id].ref_cnt == 0:
                assert block_id not in self.lru
                self.lru[block_id] = None
        self.live.pop(req.request_id, None)

    def _pick(self, pool: dict[str, Request], index: int) -> Request:
        return pool[sorted(pool)[index % len(pool)]]

    # ---- operations (plain methods, so the soak below can drive them too) ------------------
    def new_request(self, tokens: list[int], chunk: int, salt: str | None, sample: int) -> None:
        req = Request(EngineCoreRequest(self._new_id(), tokens, SamplingParams(cache_salt=salt)))
        self.history.append(list(tokens))
        self._admit(req, chunk, sample)

    def shared_prefix_request(self, index: int, prefix_len: int, suffix: list[int], chunk: int,
                              sample: int) -> None:
        """A prompt that repeats (part of) an earlier sequence, so it should hit the cache."""
        base = self.history[index % len(self.history)]
        tokens = base[:max(1, prefix_len % (len(base) + 1))] + suffix
        self.new_request(tokens, chunk, None, sample)

    def continue_live_request(self, index: int, suffix: list[int], chunk: int, sample: int) -> None:
        """A new prompt extending a live request's sequence (a multi-turn follow-up)."""
        base = self._pick(self.live, index)
        self.new_request(list(base.all_token_ids) + suffix, chunk, base.sampling_params.cache_salt,
                         sample)

    def advance(self, index: int, chunk: int, sample: int) -> None:
        """One scheduler step for a live request: the next prefill chunk, or one decode token."""
        req = self._pick(self.live, index)
        num_new = min(chunk, req.num_tokens - req.num_computed_tokens)
        assert num_new > 0
        if self._allocate(req, num_new):
            self._compute(req, num_new, sample)

    def finish(self, index: int) -> None:
        self._release(self._pick(self.live, index))

    def abort(self, index: int) -> None:
        """Abort anything: a live request frees its blocks, a waiting one holds none."""
        pool = {**self.live, **self.waiting}
        req = self._pick(pool, index)
        if req.request_id in self.live:
            self._release(req)
        else:
            self.abort_waiting(sorted(self.waiting).index(req.request_id))

    def abort_waiting(self, index: int) -> None:
        req = self._pick(self.waiting, index)
        before = self._snapshot()
        self.mgr.free(req)
        assert self._snapshot() == before
        del self.waiting[req.request_id]

    def preempt(self, index: int) -> None:
        req = self._pick(self.live, index)
        self._release(req)
        req.num_computed_tokens = 0
        req.num_preemptions += 1
        self.waiting[req.request_id] = req

    def resume(self, index: int, chunk: int, sample: int) -> None:
        self._admit(self._pick(self.waiting, index), chunk, sample)

    def evict_under_pressure(self) -> None:
        """A request with fresh tokens that takes every free block: all cached free blocks go."""
        pool = self.mgr.pool
        num_free, num_evictable = pool.num_free_blocks, pool.num_evictable_blocks
        evictions = pool.num_evictions
        tokens = list(range(self.unique_token, self.unique_token + num_free * self.bs))
        self.unique_token += len(tokens)
        req = Request(EngineCoreRequest(self._new_id(), tokens, SamplingParams()))
        self._admit(req, len(tokens), 0)
        assert req.request_id in self.live, "an allocation of exactly the free blocks failed"
        assert pool.num_free_blocks == 0
        assert pool.num_evictions == evictions + num_evictable

    def overcommit(self, extra_blocks: int) -> None:
        """A request needing more blocks than are free must fail and change nothing."""
        num_free = self.mgr.pool.num_free_blocks
        tokens = list(range(self.unique_token, self.unique_token + (num_free + extra_blocks) * self.bs))
        self.unique_token += len(tokens)
        req = Request(EngineCoreRequest(self._new_id(), tokens, SamplingParams()))
        before = self._snapshot()
        self._admit(req, len(tokens), 0)
        assert req.request_id not in self.live and req.request_id not in self.mgr.req_to_blocks
        assert self._snapshot() == before
        del self.waiting[req.request_id]

    def reset_prefix_cache(self) -> None:
        in_use = self.mgr.pool.num_used_blocks
        before = self._snapshot()
        ok = self.mgr.reset_prefix_cache()
        assert ok == (in_use == 0)
        if not ok:
            assert self._snapshot() == before
        else:
            assert not self.mgr.pool._cached
            assert all(b.block_hash is None for b in self.mgr.pool.blocks)

    # ---- invariants ------------------------------------------------------------------------
    def check_all(self) -> None:
        mgr, pool = self.mgr, self.mgr.pool
        mgr.check_integrity()
        # free + in use == total, and the queue is exactly the model's LRU order.
        assert pool.num_free_blocks + pool.num_used_blocks == pool.num_blocks
        assert list(pool._free) == list(self.lru)
        assert all(pool.blocks[i].ref_cnt == 0 for i in pool._free), "a held block is in the free queue"
        # The manager's tables are the model's.
        assert {r for r, t in mgr.req_to_blocks.items() if t} == {r for r, t in self.tables.items() if t}
        for rid, table in self.tables.items():
            assert mgr.get_block_ids(rid) == table
        assert not set(self.live) & set(self.waiting)
        assert all(r not in mgr.req_to_blocks for r in self.waiting)
        # Ref count == number of live tables holding the block.
        holders: dict[int, int] = {}
        for table in self.tables.values():
            for b in table:
                holders[b] = holders.get(b, 0) + 1
        for block in pool.blocks:
            assert block.ref_cnt == holders.get(block.block_id, 0)
        # Every published key names the tokens really written into its block.
        for k, block in pool._cached.items():
            assert self.kv[block.block_id] == list(k.token_ids)
        # A live request still reads back its own computed tokens.
        for rid, req in self.live.items():
            table = self.tables[rid]
            for pos in range(req.num_computed_tokens):
                assert self.kv[table[pos // self.bs]][pos % self.bs] == req.all_token_ids[pos], \
                    f"{rid}'s KV at position {pos} was overwritten"
        self._check_sharing()

    def _check_sharing(self) -> None:
        """Two live tables share a block only at the same index, inside an identical prefix of full
        blocks with the same salt (i.e. through a cache hit)."""
        reqs = sorted(self.live.values(), key=lambda r: r.request_id)
        for i, a in enumerate(reqs):
            pos_a = {b: j for j, b in enumerate(self.tables[a.request_id])}
            for b in reqs[i + 1:]:
                for j, block_id in enumerate(self.tables[b.request_id]):
                    if block_id not in pos_a:
                        continue
                    assert pos_a[block_id] == j, f"block {block_id} at different positions"
                    end = (j + 1) * self.bs
                    assert a.num_tokens >= end and b.num_tokens >= end
                    assert a.all_token_ids[:end] == b.all_token_ids[:end], "shared block, different prefix"
                    assert a.sampling_params.cache_salt == b.sampling_params.cache_salt


class KVCacheStateMachine(RuleBasedStateMachine, KVCacheMachine):
    """The Hypothesis face of the machine: each rule draws arguments and calls an operation."""

    def __init__(self) -> None:
        RuleBasedStateMachine.__init__(self)
        KVCacheMachine.__init__(self)

    @rule(tokens=st.lists(ALPHABET, min_size=1, max_size=6 * BLOCK_SIZE), chunk=st.integers(1, 24),
          salt=SALTS, sample=ALPHABET)
    def r_new_request(self, tokens, chunk, salt, sample):
        self.new_request(tokens, chunk, salt, sample)

    @precondition(lambda self: self.history)
    @rule(index=st.integers(0, 1000), prefix_len=st.integers(0, 100),
          suffix=st.lists(ALPHABET, max_size=6), chunk=st.integers(1, 24), sample=ALPHABET)
    def r_shared_prefix(self, index, prefix_len, suffix, chunk, sample):
        self.shared_prefix_request(index, prefix_len, suffix, chunk, sample)

    @precondition(lambda self: self.live)
    @rule(index=st.integers(0, 1000), suffix=st.lists(ALPHABET, min_size=1, max_size=6),
          chunk=st.integers(1, 24), sample=ALPHABET)
    def r_continue_live(self, index, suffix, chunk, sample):
        self.continue_live_request(index, suffix, chunk, sample)

    @precondition(lambda self: self.live)
    @rule(index=st.integers(0, 1000), chunk=st.integers(1, 12), samples=st.lists(ALPHABET, min_size=1, max_size=6))
    def r_advance(self, index, chunk, samples):
        """A few steps of one request (the last ones are decodes): the sequence grows."""
        for sample in samples:
            self.advance(index, chunk, sample)

    @precondition(lambda self: self.live)
    @rule(index=st.integers(0, 1000))
    def r_finish(self, index):
        self.finish(index)

    @precondition(lambda self: self.live or self.waiting)
    @rule(index=st.integers(0, 1000))
    def r_abort(self, index):
        self.abort(index)

    @precondition(lambda self: self.live)
    @rule(index=st.integers(0, 1000))
    def r_preempt(self, index):
        self.preempt(index)

    @precondition(lambda self: self.waiting)
    @rule(index=st.integers(0, 1000), chunk=st.integers(1, 24), sample=ALPHABET)
    def r_resume(self, index, chunk, sample):
        self.resume(index, chunk, sample)

    @precondition(lambda self: self.mgr.pool.num_free_blocks > 0)
    @rule()
    def r_evict_under_pressure(self):
        self.evict_under_pressure()

    @rule(extra_blocks=st.integers(1, 3))
    def r_overcommit(self, extra_blocks):
        self.overcommit(extra_blocks)

    @rule()
    def r_reset_prefix_cache(self):
        self.reset_prefix_cache()

    @invariant()
    def invariants(self):
        self.check_all()

    def teardown(self):
        # Drain: after every request ends, every block is free and every ref count 0.
        for rid in list(self.live):
            self._release(self.live[rid])
        self.check_all()
        pool = self.mgr.pool
        assert pool.num_free_blocks == pool.num_blocks and not self.mgr.req_to_blocks
        assert all(b.ref_cnt == 0 for b in pool.blocks)


KVCacheStateMachine.TestCase.settings = settings(
    max_examples=int(os.environ.get("KVTIDE_SM_EXAMPLES", "250")), stateful_step_count=40,
    deadline=None, suppress_health_check=[HealthCheck.too_slow], database=None)
TestKVCacheStateMachine = KVCacheStateMachine.TestCase


# ---- long seeded soak --------------------------------------------------------------------------

def _soak_step(m: KVCacheMachine, rng: random.Random) -> str:
    ops = ["new", "new", "advance", "advance", "advance", "advance"]
    if m.history:
        ops += ["shared", "shared"]
    if m.live:
        ops += ["continue", "finish", "preempt", "abort"]
    if m.waiting:
        ops += ["resume", "resume", "abort"]
    if m.mgr.pool.num_free_blocks and rng.random() < 0.05:
        ops.append("evict")
    ops += ["overcommit"] * (rng.random() < 0.03) + ["reset"] * (rng.random() < 0.03)
    op = rng.choice(ops)
    tok = lambda n: [rng.randint(0, 2) for _ in range(n)]  # noqa: E731
    if op == "new":
        m.new_request(tok(rng.randint(1, 6 * m.bs)), rng.randint(1, 24), rng.choice([None, "s"]),
                      rng.randint(0, 2))
    elif op == "shared":
        m.shared_prefix_request(rng.randrange(1 << 30), rng.randint(0, 100), tok(rng.randint(0, 6)),
                                rng.randint(1, 24), rng.randint(0, 2))
    elif op == "continue":
        m.continue_live_request(rng.randrange(1 << 30), tok(rng.randint(1, 6)), rng.randint(1, 24),
                                rng.randint(0, 2))
    elif op == "advance":
        if not m.live:
            return "skip"
        m.advance(rng.randrange(1 << 30), rng.randint(1, 12), rng.randint(0, 2))
    elif op == "finish":
        m.finish(rng.randrange(1 << 30))
    elif op == "preempt":
        m.preempt(rng.randrange(1 << 30))
    elif op == "abort":
        m.abort(rng.randrange(1 << 30))
    elif op == "resume":
        m.resume(rng.randrange(1 << 30), rng.randint(1, 24), rng.randint(0, 2))
    elif op == "evict":
        m.evict_under_pressure()
    elif op == "overcommit":
        m.overcommit(rng.randint(1, 3))
    elif op == "reset":
        m.reset_prefix_cache()
    # Keep the population bounded so the pool stays under pressure without starving forever.
    while len(m.waiting) > 12:
        m.abort_waiting(rng.randrange(1 << 30))
    return op


@pytest.mark.slow
@pytest.mark.parametrize("seed", [0, 1, 2, 3])
def test_kv_cache_soak(seed):
    """Seeded random walks over the same operations, ~15 s per seed (KVTIDE_SOAK_S to change).
    A failure names the seed and the step, so it replays exactly."""
    budget_s = float(os.environ.get("KVTIDE_SOAK_S", "15"))
    rng = random.Random(seed)
    deadline = time.monotonic() + budget_s
    walks = steps = 0
    while time.monotonic() < deadline:
        num_blocks = rng.choice([4, 8, 16, 32])
        m = KVCacheMachine(num_blocks=num_blocks, hash_algo=rng.choice(["sha256", "xxh128"]))
        walks += 1
        for _ in range(rng.randint(50, 400)):
            op = _soak_step(m, rng)
            try:
                m.check_all()
            except AssertionError as e:
                raise AssertionError(f"seed={seed} walk={walks} step={steps} op={op}: {e}") from e
            steps += 1
        for rid in list(m.live):
            m._release(m.live[rid])
        m.check_all()
        assert m.mgr.pool.num_free_blocks == num_blocks
    assert steps > 0
