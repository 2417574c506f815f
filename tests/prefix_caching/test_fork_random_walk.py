"""Seeded random walks over KVCacheManager with forks: allocate / compute / fork (beam-like and
sibling-like) / free, against a model of what each physical slot holds.

Copy-on-write is checked the way a model runner would see it: the copies the manager asks for are
applied before this step's tokens are written, and then every live request must read its own
tokens through its block table, and every published block must hold the tokens of its key.
"""

from __future__ import annotations

import random

import pytest

from kvtide.engine.request import EngineCoreRequest, Request
from kvtide.kv_cache.manager import KVCacheManager
from kvtide.sampling_params import SamplingParams

BS = 4


class Walk:
    def __init__(self, rng: random.Random, num_blocks: int) -> None:
        self.rng = rng
        self.mgr = KVCacheManager(num_blocks, BS)
        self.slots: dict[int, list[int | None]] = {i: [None] * BS for i in range(num_blocks)}
        self.live: dict[str, Request] = {}
        self.counter = 0
        self.num_forks = self.num_copies = 0

    def _request(self, tokens: list[int]) -> Request:
        self.counter += 1
        return Request(EngineCoreRequest(f"r{self.counter}", tokens, SamplingParams()))

    def _write(self, req: Request, num_new: int) -> None:
        """What the runner does: the requested copies first, then this step's tokens."""
        copies, _ = self.mgr.take_block_copies()
        for src, dst in copies:
            self.slots[dst] = list(self.slots[src])
        self.num_copies += len(copies)
        table = self.mgr.req_to_blocks[req.request_id]
        for pos in range(req.num_computed_tokens, req.num_computed_tokens + num_new):
            self.slots[table[pos // BS].block_id][pos % BS] = req.all_token_ids[pos]
        req.num_computed_tokens += num_new
        if req.num_computed_tokens == req.num_tokens:
            req.append_output_token(self.rng.randint(0, 2))

    def new(self) -> None:
        base = self.rng.choice(list(self.live.values())).all_token_ids \
            if self.live and self.rng.random() < 0.5 else []
        tokens = base[:self.rng.randint(0, len(base))] + \
            [self.rng.randint(0, 2) for _ in range(self.rng.randint(1, 12))]
        req = self._request(tokens)
        hits, num_hit = self.mgr.get_computed_blocks(req)
        num_new = min(self.rng.randint(1, 12), req.num_tokens - num_hit)
        if self.mgr.allocate_slots(req, num_new, hits, num_hit) is None:
            return
        req.num_computed_tokens = num_hit
        self.live[req.request_id] = req
        self._write(req, num_new)

    def advance(self) -> None:
        req = self.rng.choice(list(self.live.values()))
        num_new = min(self.rng.randint(1, 6), req.num_tokens - req.num_computed_tokens)
        if self.mgr.allocate_slots(req, num_new) is not None:
            self._write(req, num_new)

    def fork(self) -> None:
        parents = [r for r in self.live.values() if r.num_computed_tokens > 0]
        if not parents:
            return
        parent = self.rng.choice(parents)
        if self.rng.random() < 0.5:  # a beam: the computed tokens and another next token
            tokens = parent.all_token_ids[:parent.num_computed_tokens] + [self.rng.randint(0, 2)]
        else:  # a sibling: the same prompt (when the parent has computed it)
            tokens = list(parent.prompt_token_ids)
            if parent.num_computed_tokens < len(tokens):
                return
        child = self._request(tokens)
        self.mgr.fork(parent, child)
        self.live[child.request_id] = child
        self.num_forks += 1

    def free(self) -> None:
        req = self.live.pop(self.rng.choice(sorted(self.live)))
        self.mgr.free(req)

    def check(self) -> None:
        self.mgr.check_integrity()
        for req in self.live.values():
            table = self.mgr.req_to_blocks.get(req.request_id, [])
            for pos in range(req.num_computed_tokens):
                assert self.slots[table[pos // BS].block_id][pos % BS] == req.all_token_ids[pos], \
                    (req.request_id, pos)
        for block_hash, block in self.mgr.pool._cached.items():
            assert self.slots[block.block_id] == list(block_hash.token_ids), block


@pytest.mark.parametrize("seed", range(6))
def test_random_walk_with_forks(seed):
    rng = random.Random(seed)
    forks = copies = 0
    for _ in range(8):
        walk = Walk(rng, rng.choice([6, 12, 24]))
        for _ in range(300):
            ops = ["new", "advance", "advance", "fork", "fork"] if walk.live else ["new"]
            if walk.live:
                ops += ["free"]
            getattr(walk, rng.choice(ops))()
            walk.check()
        for req_id in list(walk.live):
            walk.mgr.free(walk.live.pop(req_id))
        walk.check()
        assert walk.mgr.pool.num_free_blocks == walk.mgr.num_blocks
        forks, copies = forks + walk.num_forks, copies + walk.num_copies
    assert forks > 50 and copies > 10
