"""Shared helpers for the prefix-caching and fork tests: engines on the tiny checkpoints, greedy
parameters, and a recorder of what each step scheduled."""

from __future__ import annotations

import random
from collections import defaultdict

from kvtide import LLM, SamplingParams
from kvtide.outputs import RequestOutput

BLOCK_SIZE = 16


def make_llm(model_dir: str, **kwargs) -> LLM:
    kwargs.setdefault("kv_cache_memory", "16MiB")
    kwargs.setdefault("block_size", BLOCK_SIZE)
    return LLM(model_dir, **kwargs)


def greedy(max_tokens: int = 6, **kwargs) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, **kwargs)


def tokens_of(outputs: list[RequestOutput]) -> list[list[list[int]]]:
    return [[c.token_ids for c in o.outputs] for o in outputs]


def random_tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randint(3, 258) for _ in range(n)]


def prompt_set(kind: str, num: int, seed: int = 0) -> list[list[int]]:
    """`num` prompts that share nothing, one partial block, or many full blocks."""
    rng = random.Random(seed)
    if kind == "none":
        return [[3 + i] + random_tokens(rng, rng.randint(10, 50)) for i in range(num)]
    if kind == "partial":
        prefix = random_tokens(rng, BLOCK_SIZE // 2 + 1)
        return [prefix + random_tokens(rng, rng.randint(1, 40)) for _ in range(num)]
    assert kind == "full"
    prefix = random_tokens(rng, 5 * BLOCK_SIZE)
    # The first prompt is exactly the shared full blocks: its last token must still be computed.
    return [prefix + (random_tokens(rng, (i * 7) % 30 + 1) if i else []) for i in range(num)]


class StepRecorder:
    """Wraps the executor to record, per step, the tokens each request was scheduled for and the
    blocks in use after the step."""

    def __init__(self, llm: LLM) -> None:
        self.core = llm.engine.core
        self.scheduled: dict[str, int] = defaultdict(int)
        self.steps = 0
        self.peak_used_blocks = 0
        self.block_copies = 0
        executor = self.core.executor
        inner = executor.execute

        def execute(so):
            self.steps += 1
            self.block_copies += len(so.block_copies)
            for req_id, n in so.num_scheduled_tokens.items():
                self.scheduled[req_id] += n
            out = inner(so)
            return out

        executor.execute = execute
        inner_step = self.core.step

        def step():
            outputs = inner_step()
            self.peak_used_blocks = max(self.peak_used_blocks, self.core.get_stats().num_used_blocks)
            self.core.check_integrity()
            return outputs

        self.core.step = step

    @property
    def total_scheduled(self) -> int:
        return sum(self.scheduled.values())


def assert_drained(llm: LLM) -> None:
    """No request left, nothing in use, every block free or cached-evictable."""
    core = llm.engine.core
    assert not core.has_unfinished_requests()
    core.check_integrity()
    stats = core.get_stats()
    pool = core.scheduler.kv_cache_manager.pool
    assert stats.num_used_blocks == 0
    assert pool.num_free_blocks == stats.num_blocks  # truly free + cached-evictable == total
    assert stats.num_evictable_blocks <= stats.num_blocks
