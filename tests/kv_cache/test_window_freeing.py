"""Sliding-window (and sink + window) block freeing: a request holds only the blocks its later
queries can read, the pool never leaks, prefix hits stay correct, forks and preemption still work.

Attention here: a query at p sees key j iff j <= p and j > p - W, or j < S (the sinks). A block
wholly before c - W + 1 (c: where a step starts) that holds no sink is never read again.

Three levels:
  - the manager alone, step by step (what is freed, when, and what a table then shows);
  - a seeded random walk over the manager with a fake KV store: every slot a query reads must
    hold the key of exactly the prefix it was computed after, whatever was freed and reused;
  - the scheduler through EngineCore with a fake runner whose model sees only the window.
"""

from __future__ import annotations

import itertools
import random
from dataclasses import dataclass

import pytest

from kvtide.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from kvtide.engine.core import EngineCore
from kvtide.engine.request import EngineCoreRequest, Request
from kvtide.kv_cache.block_pool import KVCacheBlock
from kvtide.kv_cache.manager import FreedBlock, KVCacheManager, cdiv
from kvtide.sampling_params import SamplingParams
from kvtide.scheduler.output import ModelRunnerOutput, SchedulerOutput

BS = 4


def visible(q: int, window: int, sinks: int) -> range | list[int]:
    """Keys a query at position q reads."""
    lo = max(q - window + 1, 0)
    return list(range(min(sinks, lo))) + list(range(lo, q + 1))


def prefix_keys(tokens: list[int]) -> list[int]:
    """keys[p]: stands for the K/V computed at p, a function of tokens[:p + 1] (hash chained)."""
    keys, h = [], 17
    for t in tokens:
        h = hash((h, t))
        keys.append(h)
    return keys


def _request(rid: str, tokens: list[int], **params) -> Request:
    return Request(EngineCoreRequest(rid, tokens, SamplingParams(**params)))


def _step(mgr: KVCacheManager, req: Request, n: int, sample: int = 5) -> list[KVCacheBlock]:
    """allocate_slots, then mark the tokens computed; a caught-up request samples `sample`."""
    new = mgr.allocate_slots(req, n)
    assert new is not None
    req.num_computed_tokens += n
    if req.num_computed_tokens == req.num_tokens:
        req.append_output_token(sample)
    return new


def _live_indices(mgr: KVCacheManager, rid: str) -> list[int]:
    return [i for i, b in enumerate(mgr.req_to_blocks[rid]) if isinstance(b, KVCacheBlock)]


def _assert_drained(mgr: KVCacheManager) -> None:
    mgr.check_integrity()
    assert not mgr.req_to_blocks
    assert mgr.pool.num_free_blocks == mgr.num_blocks and all(b.ref_cnt == 0 for b in mgr.pool.blocks)


# ---- the manager, step by step ------------------------------------------------------------------

@pytest.mark.parametrize("window, sinks", [(8, 0), (8, 6), (1, 0), (13, 1), (4, 4)])
def test_decode_holds_only_the_window_and_the_sinks(window, sinks):
    mgr = KVCacheManager(64, BS, enable_caching=True, sliding_window=window, sink_tokens=sinks)
    req = _request("r", list(range(6)))
    _step(mgr, req, 6)
    sink_blocks = cdiv(sinks, BS)
    bound = mgr.max_blocks_held(10_000, 1)
    assert bound == sink_blocks + cdiv(window + BS - 1, BS)
    for _ in range(150):
        c = req.num_computed_tokens
        new = _step(mgr, req, 1)
        assert len(new) <= 1
        first_key = max(c - window + 1, 0)
        table = mgr.req_to_blocks["r"]
        expected_live = [i for i in range(len(table)) if i < sink_blocks or (i + 1) * BS > first_key]
        assert _live_indices(mgr, "r") == expected_live
        assert mgr.num_live_blocks("r") == mgr.pool.num_used_blocks <= bound
        assert len(table) == cdiv(c + 1, BS)  # positions keep their table index
        mgr.check_integrity()
    mgr.free(req)
    _assert_drained(mgr)


def test_a_pool_of_the_bound_serves_a_long_request():
    window, total = 8, 400
    mgr = KVCacheManager(1, BS, sliding_window=window)
    num_blocks = mgr.max_blocks_held(total, 1)
    assert num_blocks < cdiv(total, BS) // 10
    mgr = KVCacheManager(num_blocks, BS, sliding_window=window)
    req = _request("r", [1])
    while req.num_tokens < total:
        _step(mgr, req, 1, sample=req.num_tokens % 7)
    assert mgr.pool.num_used_blocks <= num_blocks
    mgr.free(req)
    _assert_drained(mgr)


def test_freeing_comes_before_the_room_check():
    """At steady state a windowed request gives a block back in the same call that needs one: a
    full pool is no obstacle."""
    mgr = KVCacheManager(2, BS, enable_caching=False, sliding_window=5)
    assert mgr.max_blocks_held(1000, 1) == 2
    req = _request("r", list(range(8)))
    _step(mgr, req, 8)  # blocks 0, 1: the whole pool; keys >= 4 are read from position 8 on
    assert mgr.pool.num_free_blocks == 0
    for _ in range(30):
        _step(mgr, req, 1)
        assert mgr.num_live_blocks("r") <= 2
    mgr.free(req)
    _assert_drained(mgr)


@pytest.mark.parametrize("window, sinks, step", [(8, 0, 1), (8, 5, 1), (24, 0, 13), (3, 2, 7), (1, 0, 4),
                                                 (30, 9, 16)])
def test_max_blocks_held_is_the_exact_peak(window, sinks, step):
    """Every (start, length) a request can be scheduled at, freed by the rule: the peak it holds
    is the bound, once the request is long enough to reach it, and never more."""
    mgr = KVCacheManager(1, BS, sliding_window=window, sink_tokens=sinks)
    for total in (5, 37, 200):
        peak = 0
        for c in range(total):
            outside = mgr._outside_window(c)
            for n in range(1, min(step, total - c) + 1):
                peak = max(peak, sum(1 for i in range(cdiv(c + n, BS)) if i not in outside))
        bound = mgr.max_blocks_held(total, step)
        assert peak <= bound
        if total == 200:
            assert peak == bound


def test_prefix_hits_outside_the_window_are_not_taken():
    mgr = KVCacheManager(32, BS, sliding_window=6)
    tokens = list(range(40))
    a = _request("a", tokens)
    _step(mgr, a, 40)
    mgr.free(a)
    free_before = list(mgr.pool._free)
    b = _request("b", tokens + [99])
    hits, num_hit_tokens = mgr.get_computed_blocks(b)
    assert num_hit_tokens == 40 and len(hits) == 10
    assert mgr.allocate_slots(b, 1, hits, num_hit_tokens) is not None
    b.num_computed_tokens = 40
    # The next query (40) reads keys 35..40: blocks 8, 9 and the new block 10.
    assert _live_indices(mgr, "b") == [8, 9, 10]
    table = mgr.req_to_blocks["b"]
    assert [e.block_id for e in table[:10]] == [h.block_id for h in hits]
    assert all(isinstance(e, FreedBlock) for e in table[:8])
    assert all(h.ref_cnt == 0 and h.block_hash is not None for h in hits[:8])  # still cached, still free
    assert [i for i in mgr.pool._free] == [i for i in free_before if i not in
                                           {hits[8].block_id, hits[9].block_id, table[10].block_id}]
    assert mgr.prefix_stats.hits == 40
    mgr.check_integrity()
    mgr.free(b)
    _assert_drained(mgr)


def test_a_freed_parent_keeps_its_lineage():
    """W < block size: block 0 leaves the window before block 1 is full, so block 1 is published
    after a freed parent. While the parent stays cached the chain is hit whole; once it is reused
    and its key published again by another block, the old child no longer continues the chain
    (a hit lost, never wrong KV)."""
    mgr = KVCacheManager(6, BS, sliding_window=2)
    a = _request("a", [1, 2, 3, 4, 5])
    _step(mgr, a, 5)
    first = mgr.req_to_blocks["a"][0]
    _step(mgr, a, 1)  # starts at 5: keys >= 4, block 0 is freed
    assert isinstance(mgr.req_to_blocks["a"][0], FreedBlock) and first.ref_cnt == 0
    lineage = (first.block_id, first.generation)
    while a.num_tokens < 9:
        _step(mgr, a, 1, sample=6)
    _step(mgr, a, 1, sample=6)  # block 1 (tokens 4..7) is full and known: published
    second = mgr.req_to_blocks["a"][1]
    assert second.block_hash is not None and second.parent == lineage
    assert len(mgr._longest_cached_chain(a.block_hashes[:2])) == 2  # the parent is still cached
    assert first.block_hash is not None
    # Another request takes every free block: block 0 is evicted and reused.
    filler = _request("f", list(range(100, 100 + BS * mgr.pool.num_free_blocks)))
    _step(mgr, filler, filler.num_tokens)
    assert first.generation > lineage[1]
    mgr.free(filler)
    mgr.free(a)
    # The same first block, computed again elsewhere, is published under the same key.
    c = _request("c", a.all_token_ids[:5])
    hits, n = mgr.get_computed_blocks(c)
    assert n == 0
    _step(mgr, c, 5)
    assert mgr.req_to_blocks["c"][0].block_hash == a.block_hashes[0]
    assert second.block_hash is not None  # still cached, but computed after the old block 0
    chain = mgr._longest_cached_chain(a.block_hashes[:2])
    assert [b.block_id for b in chain] == [mgr.req_to_blocks["c"][0].block_id]
    mgr.free(c)
    _assert_drained(mgr)


def test_a_block_leaving_the_window_is_published_first():
    """Accepted drafts make a block's tokens known only at the step that frees it (W = 1): it is
    published before it is freed, so a later request still hits it."""
    mgr = KVCacheManager(16, BS, sliding_window=1)
    req = _request("r", [1, 2, 3, 4])
    _step(mgr, req, 4)
    assert mgr.allocate_slots(req, 1 + 3) is not None  # position 4 and drafts at 5, 6, 7
    req.num_computed_tokens += 4
    for token in (7, 8, 9, 10):  # the three drafts accepted, and the token after them
        req.append_output_token(token)
    second = mgr.req_to_blocks["r"][1]
    assert second.block_hash is None  # its tokens were not known when it was allocated
    _step(mgr, req, 1)  # starts at 8: keys >= 8, blocks 0 and 1 are freed
    assert isinstance(mgr.req_to_blocks["r"][1], FreedBlock) and second.ref_cnt == 0
    assert second.block_hash == req.block_hashes[1]
    follower = _request("f", req.all_token_ids[:9])
    assert mgr.get_computed_blocks(follower)[1] == 8
    mgr.free(req)
    _assert_drained(mgr)


def test_fork_shares_only_live_blocks():
    mgr = KVCacheManager(32, BS, sliding_window=6, sink_tokens=2)
    parent = _request("p", list(range(10)))
    _step(mgr, parent, 10)
    while parent.num_tokens < 31:
        _step(mgr, parent, 1, sample=parent.num_tokens % 5)
    assert parent.num_computed_tokens == 30
    child = _request("c", list(parent.all_token_ids))
    mgr.fork(parent, child)
    assert child.num_computed_tokens == 30
    p_table, c_table = mgr.req_to_blocks["p"], mgr.req_to_blocks["c"]
    assert c_table == p_table
    assert _live_indices(mgr, "p") == [0, 6, 7]  # the sink block, then keys 24..29
    assert [b.ref_cnt for b in p_table if isinstance(b, KVCacheBlock)] == [2, 2, 2]
    mgr.check_integrity()
    # The child writes 30 into the shared partial block 7: copied; then both grow apart.
    _step(mgr, child, 1, sample=1)
    copies, rewritten = mgr.take_block_copies()
    assert copies == [(p_table[7].block_id, c_table[7].block_id)] and rewritten == {"c"}
    for _ in range(20):
        _step(mgr, parent, 1, sample=2)
        _step(mgr, child, 1, sample=3)
        mgr.check_integrity()
        assert mgr.num_live_blocks("p") <= mgr.max_blocks_held(100, 1)
    assert isinstance(mgr.req_to_blocks["c"][0], KVCacheBlock)  # the sink block stays
    mgr.free(child)
    mgr.free(parent)
    _assert_drained(mgr)


def test_preempted_request_frees_again_as_it_recomputes():
    mgr = KVCacheManager(16, BS, enable_caching=False, sliding_window=5)
    req = _request("r", list(range(50)))
    for _ in range(10):
        _step(mgr, req, 5)
    mgr.free(req)  # preemption
    req.num_computed_tokens = 0
    _assert_drained(mgr)
    peak, total = 0, req.num_tokens
    while req.num_computed_tokens < total:
        _step(mgr, req, min(7, total - req.num_computed_tokens))
        peak = max(peak, mgr.num_live_blocks("r"))
    assert peak <= mgr.max_blocks_held(total, 7) < cdiv(total, BS)
    mgr.free(req)
    _assert_drained(mgr)


def test_no_window_frees_nothing():
    mgr = KVCacheManager(32, BS)
    req = _request("r", list(range(30)))
    _step(mgr, req, 30)
    for _ in range(20):
        _step(mgr, req, 1)
    assert _live_indices(mgr, "r") == list(range(cdiv(50, BS)))
    assert mgr.max_blocks_held(1000, 8) == cdiv(1000, BS)
    mgr.free(req)
    _assert_drained(mgr)


# ---- a seeded random walk over the manager ------------------------------------------------------

class WindowWalk:
    """Requests with shared prefixes and drafts, forks, preemptions and pool pressure, over a fake
    KV store the walk writes through the block tables as a model runner would (old ids kept for
    freed entries, whole tables on copy-on-write). Before a step computes, every key its queries
    read is checked to hold the K/V of exactly that prefix."""

    def __init__(self, seed: int, window: int, sinks: int, caching: bool, num_blocks: int) -> None:
        self.rng = random.Random(seed)
        self.window, self.sinks = window, sinks
        self.mgr = KVCacheManager(num_blocks, BS, enable_caching=caching, sliding_window=window,
                                  sink_tokens=sinks)
        self.kv: list[list[int | None]] = [[None] * BS for _ in range(num_blocks)]
        self.tables: dict[str, list[int]] = {}
        self.live: dict[str, Request] = {}
        self.waiting: list[Request] = []
        self.history: list[list[int]] = [[0, 1, 2, 0, 1, 2, 0, 1, 2, 0, 1]]
        self.ids = itertools.count()
        self.max_len = 90
        self.max_step = 9

    # ---- runner side -------------------------------------------------------------------------
    def _apply_copies(self) -> None:
        copies, rewritten = self.mgr.take_block_copies()
        for src, dst in copies:
            self.kv[dst] = list(self.kv[src])
        for rid in rewritten:
            self.tables[rid] = self.mgr.get_block_ids(rid)

    def _check_reads(self, req: Request, start: int, n: int) -> None:
        table = self.tables[req.request_id]
        keys = prefix_keys(req.all_token_ids[:start])
        mgr_table = self.mgr.req_to_blocks[req.request_id]
        for q in range(start, start + n):
            for j in visible(q, self.window, self.sinks):
                if j < start:
                    assert isinstance(mgr_table[j // BS], KVCacheBlock), (req.request_id, q, j)
                    assert self.kv[table[j // BS]][j % BS] == keys[j], (req.request_id, q, j)
        for q in range(start, start + n):
            block = mgr_table[q // BS]
            assert isinstance(block, KVCacheBlock) and block.ref_cnt == 1, "writes into a shared block"

    def _write(self, req: Request, tokens: list[int], start: int, n: int) -> None:
        table, keys = self.tables[req.request_id], prefix_keys(tokens[:start + n])
        for q in range(start, start + n):
            self.kv[table[q // BS]][q % BS] = keys[q]

    # ---- scheduler side ----------------------------------------------------------------------
    def _token(self) -> int:
        return self.rng.randrange(3)

    def _new_request(self) -> None:
        base = self.rng.choice(self.history)
        prompt = base[:self.rng.randrange(1, len(base) + 1)] + [self._token() for _ in range(self.rng.randrange(3))]
        self.waiting.append(_request(f"r{next(self.ids)}", prompt[:self.max_len - 1]))

    def _admit(self, req: Request) -> bool:
        hits, num_hit = self.mgr.get_computed_blocks(req)
        n = min(self.rng.randrange(1, self.max_step + 1), req.num_tokens - num_hit)
        new = self.mgr.allocate_slots(req, n, hits, num_hit)
        if new is None:
            return False
        req.num_computed_tokens = num_hit
        self.waiting.remove(req)
        self.live[req.request_id] = req
        self.tables[req.request_id] = self.mgr.get_block_ids(req.request_id)
        self._apply_copies()
        self._compute(req, n, 0)
        return True

    def _advance(self, req: Request) -> None:
        lacking = req.num_tokens - req.num_computed_tokens
        drafts = 0
        if lacking == 1 and self.rng.random() < 0.4:
            drafts = min(self.rng.randrange(1, 4), self.max_len - req.num_tokens - 1)
        n = min(self.rng.randrange(1, self.max_step + 1), lacking) + drafts
        while True:
            new = self.mgr.allocate_slots(req, n)
            if new is not None:
                break
            victim = max(self.live.values(), key=lambda r: int(r.request_id[1:]))
            self._preempt(victim)
            if victim is req:
                return
        self.tables[req.request_id].extend(b.block_id for b in new)
        self._apply_copies()
        self._compute(req, n, drafts)

    def _compute(self, req: Request, n: int, drafts: int) -> None:
        start = req.num_computed_tokens
        assert self.mgr.num_live_blocks(req.request_id) <= self.mgr.max_blocks_held(self.max_len, self.max_step)
        self._check_reads(req, start, n)
        draft_tokens = [self._token() for _ in range(drafts)]
        self._write(req, req.all_token_ids + draft_tokens, start, n)
        req.num_computed_tokens += n
        if req.num_computed_tokens < req.num_tokens + drafts:
            return
        accepted = self.rng.randrange(drafts + 1)
        req.num_computed_tokens -= drafts - accepted  # rejected drafts' slots are rewritten later
        for t in draft_tokens[:accepted] + [self._token()]:
            req.append_output_token(t)
        if req.num_tokens >= self.max_len or self.rng.random() < 0.03:
            self._finish(req)

    def _preempt(self, req: Request) -> None:
        self.mgr.free(req)
        self.tables.pop(req.request_id)
        del self.live[req.request_id]
        req.num_computed_tokens = 0
        req.num_preemptions += 1
        self.waiting.insert(0, req)

    def _finish(self, req: Request) -> None:
        self.mgr.free(req)
        self.tables.pop(req.request_id)
        del self.live[req.request_id]
        self.history.append(list(req.all_token_ids))

    def _fork(self) -> None:
        parents = [r for r in self.live.values() if r.num_computed_tokens == r.num_tokens - 1]
        if not parents:
            return
        parent = self.rng.choice(parents)
        child = _request(f"r{next(self.ids)}", list(parent.prompt_token_ids))
        child.all_token_ids = list(parent.all_token_ids)
        child.output_token_ids = list(parent.output_token_ids)
        self.mgr.fork(parent, child)
        self.live[child.request_id] = child
        self.tables[child.request_id] = self.mgr.get_block_ids(child.request_id)

    def run(self, num_ops: int) -> None:
        for _ in range(num_ops):
            op = self.rng.random()
            if op < 0.15 or not (self.live or self.waiting):
                self._new_request()
            elif op < 0.3 and self.waiting:
                self._admit(self.waiting[0])
            elif op < 0.35:
                self._fork()
            elif op < 0.38 and self.live:
                self._preempt(self.rng.choice(list(self.live.values())))
            elif self.live:
                self._advance(self.rng.choice(list(self.live.values())))
            self.mgr.check_integrity()
            assert self.mgr.pool.num_used_blocks == len({b.block_id for t in self.mgr.req_to_blocks.values()
                                                         for b in t if isinstance(b, KVCacheBlock)})
        for req in list(self.live.values()):
            self._finish(req)
        _assert_drained(self.mgr)


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("window, sinks, caching", [(1, 0, True), (3, 2, True), (8, 0, True), (8, 5, False),
                                                    (13, 4, True)])
def test_random_walk_reads_only_intact_kv(seed, window, sinks, caching):
    walk = WindowWalk(seed, window, sinks, caching, num_blocks=40)
    walk.run(1500)


# ---- the scheduler, through EngineCore ----------------------------------------------------------

VOCAB = 40


def window_token(rid: str, visible_tokens: list[int]) -> int:
    """The fake model: a function of the tokens a windowed query sees (and of the sample)."""
    h = hash((rid.split("_")[0] == "b", tuple(visible_tokens)))
    return h % VOCAB


def expected_tokens(rid: str, prompt: list[int], max_tokens: int, window: int, sinks: int) -> list[int]:
    seq = list(prompt)
    for _ in range(max_tokens):
        seq.append(window_token(rid, [seq[j] for j in visible(len(seq) - 1, window, sinks)]))
    return seq[len(prompt):]


@dataclass
class _State:
    token_ids: list[int]
    block_ids: list[int]
    num_computed_tokens: int


class WindowRunner:
    """An Executor whose model reads K/V only inside the window (plus the sinks), through the
    block table as the scheduler sent it; each slot holds the key of the prefix it was computed
    after, so a read of a freed-and-reused block shows up."""

    def __init__(self, num_blocks: int, window: int, sinks: int) -> None:
        self.window, self.sinks = window, sinks
        self.kv: list[list[int | None]] = [[None] * BS for _ in range(num_blocks)]
        self.states: dict[str, _State] = {}

    def execute(self, so: SchedulerOutput) -> ModelRunnerOutput:
        for rid in so.finished_req_ids:
            self.states.pop(rid, None)
        for src, dst in so.block_copies:
            self.kv[dst] = list(self.kv[src])
        for new in so.scheduled_new_reqs:
            self.states[new.request_id] = _State(list(new.token_ids), list(new.block_ids), new.num_computed_tokens)
        for cached in so.scheduled_cached_reqs:
            state = self.states[cached.request_id]
            assert cached.num_computed_tokens == state.num_computed_tokens
            state.block_ids.extend(cached.new_block_ids)
        out = ModelRunnerOutput(sampled_token_ids={})
        for rid, n in so.num_scheduled_tokens.items():
            state = self.states[rid]
            start = state.num_computed_tokens
            keys = prefix_keys(state.token_ids[:start + n])
            for q in range(start, start + n):
                self._slot(state, q)[q % BS] = keys[q]
            for q in range(start, start + n):
                seen = [j for j in visible(q, self.window, self.sinks)]
                assert all(self._slot(state, j)[j % BS] == keys[j] for j in seen), f"{rid} read stale KV at {q}"
            state.num_computed_tokens += n
            if state.num_computed_tokens == len(state.token_ids):
                p = len(state.token_ids) - 1
                token = window_token(rid, [state.token_ids[j] for j in visible(p, self.window, self.sinks)])
                state.token_ids.append(token)
                out.sampled_token_ids[rid] = token
        return out

    def _slot(self, state: _State, pos: int) -> list[int | None]:
        return self.kv[state.block_ids[pos // BS]]

    def shutdown(self) -> None:
        pass


def make_core(window: int, sinks: int, num_blocks: int, budget: int = 16, caching: bool = True,
              async_scheduling: bool = False, max_model_len: int = 512) -> EngineCore:
    config = EngineConfig(
        ModelConfig(model="fake", hf_config=None, max_model_len=max_model_len),
        CacheConfig(block_size=BS, num_blocks=num_blocks, enable_prefix_caching=caching,
                    sliding_window=window, kv_sink_tokens=sinks),
        SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=budget, enable_chunked_prefill=True,
                        async_scheduling=async_scheduling))
    return EngineCore(config, WindowRunner(num_blocks, window, sinks))


def run_core(core: EngineCore, requests: list[EngineCoreRequest]) -> tuple[dict[str, list[int]], dict[str, int]]:
    """Add the requests, step until done; the tokens of each and the most blocks each held."""
    tokens = {r.request_id: [] for r in requests}
    peak = dict.fromkeys(tokens, 0)
    for r in requests:
        core.add_request(r)
    mgr = core.scheduler.kv_cache_manager
    for _ in range(20_000):
        if not core.has_unfinished_requests():
            break
        for out in core.step():
            tokens[out.request_id].extend(out.new_token_ids)
        for rid in mgr.req_to_blocks:
            peak[rid] = max(peak[rid], mgr.num_live_blocks(rid))
        core.check_integrity()
    assert not core.has_unfinished_requests()
    _assert_drained(mgr)
    return tokens, peak


def core_request(rid: str, prompt: list[int], max_tokens: int, fork_of: str | None = None) -> EngineCoreRequest:
    return EngineCoreRequest(rid, prompt, SamplingParams(max_tokens=max_tokens, ignore_eos=True), [],
                             fork_of=fork_of)


def prompt_of(n: int, salt: int) -> list[int]:
    return [(salt * 7 + i * 3) % VOCAB for i in range(n)]


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
@pytest.mark.parametrize("window, sinks", [(6, 0), (6, 3), (17, 5)])
def test_engine_outputs_equal_the_windowed_model_and_blocks_stay_bounded(window, sinks, async_scheduling):
    budget = 16
    core = make_core(window, sinks, num_blocks=64, budget=budget, async_scheduling=async_scheduling)
    requests = [core_request(f"r{i}", prompt_of(5 + 11 * i, i), 150 + 20 * i) for i in range(4)]
    tokens, peak = run_core(core, requests)
    bound = core.scheduler.kv_cache_manager.max_blocks_held(400, budget)
    for r in requests:
        assert tokens[r.request_id] == expected_tokens(r.request_id, r.prompt_token_ids,
                                                       r.sampling_params.max_tokens, window, sinks)
        assert peak[r.request_id] <= bound < cdiv(len(r.prompt_token_ids) + r.sampling_params.max_tokens, BS)


def test_a_long_request_that_fits_the_window_is_admitted():
    window, sinks, budget = 6, 2, 8
    probe = make_core(window, sinks, num_blocks=1, budget=budget).scheduler.kv_cache_manager
    num_blocks = probe.max_blocks_held(500, budget)
    assert num_blocks < cdiv(500, BS) // 10
    core = make_core(window, sinks, num_blocks=num_blocks, budget=budget, caching=False)
    request = core_request("r", prompt_of(40, 1), 460)
    tokens, peak = run_core(core, [request])
    assert tokens["r"] == expected_tokens("r", request.prompt_token_ids, 460, window, sinks)
    assert peak["r"] <= num_blocks
    too_wide = make_core(400, 0, num_blocks=num_blocks, budget=budget)
    with pytest.raises(ValueError, match="KV blocks"):
        too_wide.add_request(core_request("w", prompt_of(40, 1), 460))


@pytest.mark.parametrize("caching", [False, True])
def test_preemption_with_a_window(caching):
    window, budget = 6, 16
    num_blocks = 12
    core = make_core(window, 0, num_blocks=num_blocks, budget=budget, caching=caching)
    requests = [core_request(f"r{i}", prompt_of(9 + 5 * i, i), 80) for i in range(5)]
    tokens, _ = run_core(core, requests)
    assert core.scheduler.num_preemptions > 0
    for r in requests:
        assert tokens[r.request_id] == expected_tokens(r.request_id, r.prompt_token_ids, 80, window, 0)


def test_prefix_hits_with_a_window_are_correct():
    window, sinks = 6, 3
    core = make_core(window, sinks, num_blocks=64)
    prompt = prompt_of(60, 3)
    first, _ = run_core(core, [core_request("a", prompt, 30)])
    again = core_request("a2", prompt, 30)
    extended = core_request("a3", prompt + first["a"][:10], 20)
    tokens, _ = run_core(core, [again, extended])
    assert core.scheduler.kv_cache_manager.prefix_stats.hits > 0
    assert tokens["a2"] == expected_tokens("a2", prompt, 30, window, sinks) == first["a"]
    assert tokens["a3"] == expected_tokens("a3", extended.prompt_token_ids, 20, window, sinks)


def test_fork_of_a_sibling_with_a_window():
    window, sinks = 6, 2
    core = make_core(window, sinks, num_blocks=64)
    prompt = prompt_of(45, 4)
    requests = [core_request("a_x", prompt, 60), core_request("b_x", prompt, 60, fork_of="a_x")]
    tokens, peak = run_core(core, requests)
    for r in requests:
        assert tokens[r.request_id] == expected_tokens(r.request_id, prompt, 60, window, sinks)
    assert tokens["a_x"] != tokens["b_x"]
    assert max(peak.values()) <= core.scheduler.kv_cache_manager.max_blocks_held(105, 16)
