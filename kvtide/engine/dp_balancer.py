"""Which data-parallel engine (replica) serves a request: by load, and by prefix affinity.

    route(request ids, prompt token ids)
      1. the prompt's whole KV blocks as the prefix cache keys them (kv_cache/prefix_cache.py);
      2. per engine, how many leading blocks it served before (its PrefixIndex, an LRU bounded by
         the engine's KV blocks, since the engine cannot keep more cached either);
      3. the engine with the longest match wins (ties: the least loaded, then round robin),
         unless its load exceeds the least-loaded engine's by more than `load_threshold`:
         then the least-loaded engine takes it (and from then on holds that prefix too);
      4. the prompt's block hashes are recorded for the chosen engine, and its load grows by the
         request's engine-core requests (n > 1 children all go to that one engine).

An engine holds the engine-core requests sent to it until they finish, fail or are aborted; each
waits until the engine first schedules it (the engine reports that with its outputs), then runs.
Its load is vLLM's DP balancing score, running + 4 x waiting: a request not yet scheduled still owes
its whole prefill, so a burst of arrivals (a wave of requests started as a wave finished) is spread
over the engines instead of queueing its prefills on the one that happened to be emptiest. The counts
are exact from the client's side and need no round trip. Pure Python, no processes: the policy is
tested on its own.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from kvtide.kv_cache.prefix_cache import get_hash_fn, hash_request_blocks

DEFAULT_LOAD_THRESHOLD = 1
"""Load a prefix-matching engine may have beyond the least-loaded engine's and still be chosen: one
more running request. A waiting request (4) already tips it to the least-loaded engine. Measured
(scripts/bench_data_parallel.py, 4 shared 256-token prefixes, 8 in flight, 2 replicas): at 4,
affinity piled 19 of 32 requests on one replica and served 0.92-0.96x the requests per second of
two round-robin servers; at 1 the split was 17-18 / 15-16, the prefix hits still above round robin's,
and 1.03x. Each hit saves a prefill, but an uneven split idles a replica's cores at the tail."""
WAITING_WEIGHT = 4
"""A waiting request counts as this many running ones in an engine's load (vLLM's DP balancer)."""
DEFAULT_MAX_BLOCKS_PER_ENGINE = 1 << 16
"""Block hashes remembered per engine when the engine's KV pool size is not known."""

_HASH_FN = get_hash_fn("xxh128")


def block_hashes(token_ids: Sequence[int], block_size: int, cache_salt: str | None = None) -> list[bytes]:
    """The prefix cache's keys of the prompt's full blocks (kv_cache/prefix_cache.py: chained, so
    block i's depends on every token before it, a salt in the first), as their hash values."""
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    keys: list = []
    hash_request_blocks(_HASH_FN, token_ids, block_size, keys, cache_salt)
    return [key.hash_value for key in keys]


class PrefixIndex:
    """The block hashes one engine computed recently, least recently used first."""

    def __init__(self, max_blocks: int) -> None:
        if max_blocks < 1:
            raise ValueError(f"max_blocks must be >= 1, got {max_blocks}")
        self.max_blocks = max_blocks
        self._blocks: OrderedDict[bytes, None] = OrderedDict()

    def __len__(self) -> int:
        return len(self._blocks)

    def __contains__(self, block_hash: bytes) -> bool:
        return block_hash in self._blocks

    def match(self, hashes: Sequence[bytes]) -> int:
        """Leading blocks of `hashes` this engine holds."""
        n = 0
        for h in hashes:
            if h not in self._blocks:
                break
            n += 1
        return n

    def insert(self, hashes: Iterable[bytes]) -> None:
        """Record (or refresh) the blocks; the oldest go once over max_blocks."""
        blocks = self._blocks
        for h in hashes:
            if h in blocks:
                blocks.move_to_end(h)
            else:
                blocks[h] = None
        while len(blocks) > self.max_blocks:
            blocks.popitem(last=False)

    def clear(self) -> None:
        self._blocks.clear()


@dataclass
class EngineCounters:
    """Per engine, since start: what the balancer sent it and why."""

    requests: int = 0
    """User requests routed here (one per add, whatever n)."""
    affinity_requests: int = 0
    """... of which a prefix match decided."""
    matched_blocks: int = 0
    """Prompt blocks those requests matched here."""


@dataclass
class Decision:
    engine: int
    matched_blocks: int
    by_affinity: bool
    hashes: list[bytes] = field(default_factory=list)


class DPLoadBalancer:
    """Routes requests to `num_engines` engines and remembers which engine holds which request."""

    def __init__(self, num_engines: int, block_size: int = 16, enable_prefix_affinity: bool = True,
                 load_threshold: int = DEFAULT_LOAD_THRESHOLD, waiting_weight: int = WAITING_WEIGHT,
                 max_blocks_per_engine: int | Sequence[int] = DEFAULT_MAX_BLOCKS_PER_ENGINE) -> None:
        if num_engines < 1:
            raise ValueError(f"num_engines must be >= 1, got {num_engines}")
        if load_threshold < 0:
            raise ValueError(f"load_threshold must be >= 0, got {load_threshold}")
        if waiting_weight < 1:
            raise ValueError(f"waiting_weight must be >= 1, got {waiting_weight}")
        sizes = [max_blocks_per_engine] * num_engines if isinstance(max_blocks_per_engine, int) \
            else list(max_blocks_per_engine)
        if len(sizes) != num_engines:
            raise ValueError(f"max_blocks_per_engine: got {len(sizes)} sizes for {num_engines} engines")
        self.num_engines = num_engines
        self.block_size = block_size
        self.enable_prefix_affinity = enable_prefix_affinity
        self.load_threshold = load_threshold
        self.waiting_weight = waiting_weight
        self.indexes = [PrefixIndex(n) for n in sizes]
        self.held = [0] * num_engines
        """Engine-core requests each engine holds (waiting + running)."""
        self.waiting = [0] * num_engines
        """... of which not scheduled yet."""
        self.counters = [EngineCounters() for _ in range(num_engines)]
        self._owner: dict[str, int] = {}
        self._waiting: set[str] = set()
        self._next = 0

    @property
    def loads(self) -> list[int]:
        """Each engine's load: running + waiting_weight x waiting."""
        return [held + (self.waiting_weight - 1) * waiting for held, waiting in zip(self.held, self.waiting,
                                                                                     strict=True)]

    # ---- choice ------------------------------------------------------------------------------
    def choose(self, prompt_token_ids: Sequence[int], cache_salt: str | None = None) -> Decision:
        """Where a request with this prompt should go (nothing is recorded)."""
        hashes = block_hashes(prompt_token_ids, self.block_size, cache_salt) \
            if self.enable_prefix_affinity and self.num_engines > 1 else []
        matches = [index.match(hashes) for index in self.indexes] if hashes else [0] * self.num_engines
        loads = self.loads
        least = min(loads)
        longest = max(matches)
        if longest > 0:
            best = self._pick([e for e in range(self.num_engines) if matches[e] == longest], loads)
            if loads[best] - least <= self.load_threshold:
                return Decision(best, longest, True, hashes)
        # Load decides: among the least loaded, the longest match (often 0), then round robin.
        idle = [e for e in range(self.num_engines) if loads[e] == least]
        top = max(matches[e] for e in idle)
        engine = self._pick([e for e in idle if matches[e] == top])
        return Decision(engine, matches[engine], False, hashes)

    def _pick(self, candidates: list[int], loads: list[int] | None = None) -> int:
        if loads is not None:
            low = min(loads[e] for e in candidates)
            candidates = [e for e in candidates if loads[e] == low]
        if len(candidates) == 1:
            return candidates[0]
        # Round robin between equals, so that idle engines share a trickle of unrelated requests.
        return min(candidates, key=lambda e: (e - self._next) % self.num_engines)

    # ---- bookkeeping -------------------------------------------------------------------------
    def route(self, request_ids: Sequence[str], prompt_token_ids: Sequence[int],
              cache_salt: str | None = None) -> int:
        """Choose the engine for one user request's engine-core requests (all of them, n > 1 or
        not, on one engine: the samples share the prompt's blocks there) and record it."""
        if not request_ids:
            raise ValueError("route needs at least one request id")
        for rid in request_ids:
            if rid in self._owner:
                raise ValueError(f"request id {rid!r} is already routed (engine {self._owner[rid]})")
        decision = self.choose(prompt_token_ids, cache_salt)
        self.assign(request_ids, decision)
        return decision.engine

    def assign(self, request_ids: Sequence[str], decision: Decision) -> None:
        engine = decision.engine
        for rid in request_ids:
            self._owner[rid] = engine
        self._waiting.update(request_ids)
        self.held[engine] += len(request_ids)
        self.waiting[engine] += len(request_ids)
        self._next = (engine + 1) % self.num_engines
        counters = self.counters[engine]
        counters.requests += 1
        if decision.by_affinity:
            counters.affinity_requests += 1
            counters.matched_blocks += decision.matched_blocks
        if decision.hashes:
            self.indexes[engine].insert(decision.hashes)

    def engine_of(self, request_id: str) -> int | None:
        return self._owner.get(request_id)

    def group_by_engine(self, request_ids: Iterable[str]) -> dict[int, list[str]]:
        """The ids each engine holds (unknown ids, e.g. already finished, are left out)."""
        groups: dict[int, list[str]] = {}
        for rid in request_ids:
            engine = self._owner.get(rid)
            if engine is not None:
                groups.setdefault(engine, []).append(rid)
        return groups

    def mark_scheduled(self, request_ids: Iterable[str]) -> None:
        """The engine scheduled these requests for the first time: they run now. Idempotent."""
        for rid in request_ids:
            if rid in self._waiting:
                self._waiting.discard(rid)
                self.waiting[self._owner[rid]] -= 1

    def finish(self, request_ids: Iterable[str]) -> None:
        """The requests left their engine (finished, stopped, aborted or refused). Idempotent."""
        request_ids = list(request_ids)
        self.mark_scheduled(request_ids)
        for rid in request_ids:
            engine = self._owner.pop(rid, None)
            if engine is not None:
                self.held[engine] -= 1

    def forget_prefixes(self, engine: int | None = None) -> None:
        """An engine's prefix cache was reset (None: every engine's)."""
        for e, index in enumerate(self.indexes):
            if engine is None or e == engine:
                index.clear()

    @property
    def num_requests(self) -> int:
        return len(self._owner)
