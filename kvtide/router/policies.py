"""Routing policies: which healthy backend of a pool gets a request.

    round_robin   the next one in turn
    least_load    the fewest requests the router has in flight on it (ties: in turn)
    cache_aware   the backend that was sent the longest prefix of this prompt, when that prefix is
                  at least `cache_threshold` of the prompt AND the backend has at most
                  `balance_threshold` more requests in flight than the least-loaded healthy backend;
                  otherwise least_load. The prompt is then recorded for the chosen backend, so one
                  hot prefix stays on one backend until that backend is overloaded, then spills;
                  so is its answer once relayed (prompt_text.answer_text), so a conversation's
                  next turn, whose prompt repeats the answer, matches in full.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

from kvtide.router.backends import Backend, BackendPool
from kvtide.router.prefix_index import CHUNK_CHARS, PrefixIndex, chunk_hashes


@dataclass
class Choice:
    """A routing decision: the backend, and for cache_aware why it was picked (`by_prefix`) and
    the matched share of the prompt (None for the other policies)."""

    backend: Backend
    by_prefix: bool = False
    matched_ratio: float | None = None


class Policy:
    """Chooses among a pool's healthy backends not in `exclude` (those a retry already tried);
    None when there is none."""

    def __init__(self, pool: BackendPool) -> None:
        self.pool = pool
        self._turn = itertools.count()

    def choose(self, prompt_text: str, exclude: set[Backend]) -> Choice | None:
        raise NotImplementedError

    def _in_turn(self, candidates: list[Backend]) -> Backend:
        return candidates[next(self._turn) % len(candidates)]


class RoundRobin(Policy):
    def choose(self, prompt_text: str, exclude: set[Backend]) -> Choice | None:
        # Turn over the whole pool, skipping the unavailable, so a backend that comes back
        # gets its turn again at the same place.
        backends = self.pool.backends
        for _ in range(len(backends)):
            backend = backends[next(self._turn) % len(backends)]
            if backend.healthy and backend not in exclude:
                return Choice(backend)
        return None


class LeastLoad(Policy):
    def choose(self, prompt_text: str, exclude: set[Backend]) -> Choice | None:
        candidates = self.pool.available(exclude)
        if not candidates:
            return None
        return Choice(self._least_loaded(candidates))

    def _least_loaded(self, candidates: list[Backend]) -> Backend:
        lowest = min(b.in_flight for b in candidates)
        return self._in_turn([b for b in candidates if b.in_flight == lowest])


class CacheAware(LeastLoad):
    def __init__(self, pool: BackendPool, cache_threshold: float, balance_threshold: int,
                 chunk_chars: int = CHUNK_CHARS) -> None:
        super().__init__(pool)
        self.cache_threshold = cache_threshold
        self.balance_threshold = balance_threshold
        self.chunk_chars = chunk_chars
        self.index = PrefixIndex()

    def choose(self, prompt_text: str, exclude: set[Backend]) -> Choice | None:
        candidates = self.pool.available(exclude)
        if not candidates:
            return None
        hashes = chunk_hashes(prompt_text, self.chunk_chars)
        best, best_chunks = None, 0
        for backend in candidates:
            matched = self.index.matched_chunks(backend.url, hashes)
            if matched > best_chunks:
                best, best_chunks = backend, matched
        ratio = best_chunks * self.chunk_chars / len(prompt_text) if prompt_text else 0.0
        lowest = min(b.in_flight for b in candidates)
        if best is not None and ratio >= self.cache_threshold and best.in_flight - lowest <= self.balance_threshold:
            choice = Choice(best, by_prefix=True, matched_ratio=ratio)
        else:
            choice = Choice(self._least_loaded(candidates), matched_ratio=ratio)
        self.index.insert(choice.backend.url, hashes)
        return choice

    def record_answer(self, backend: Backend, prompt_text: str, answer_text: str) -> None:
        """Remember that `backend` now also holds the answer after the prompt (its KV is in that
        backend's prefix cache too), so the conversation's next turn, which repeats both, follows it."""
        if answer_text:
            self.index.insert(backend.url, chunk_hashes(prompt_text + answer_text, self.chunk_chars))


def make_policy(name: str, pool: BackendPool, cache_threshold: float, balance_threshold: int) -> Policy:
    if name == "round_robin":
        return RoundRobin(pool)
    if name == "least_load":
        return LeastLoad(pool)
    if name == "cache_aware":
        return CacheAware(pool, cache_threshold, balance_threshold)
    raise ValueError(f"unknown policy {name!r}")
