"""Messages the engine core emits per step. Plain dataclasses of builtins, so they serialize with
msgspec across the ZMQ channel without pickle."""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field


@dataclass
class EngineCoreOutput:
    request_id: str
    new_token_ids: list[int]
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    # Per new token: (chosen logprob, chosen rank, top ids, top logprobs).
    new_logprobs: list[tuple[float, int, list[int], list[float]]] | None = None
    # Per prompt position computed this step (position 0 has none and is omitted).
    new_prompt_logprobs: list[tuple[float, int, list[int], list[float]]] | None = None
    num_cached_tokens: int = 0
    error: str | None = None
    kv_transfer_params: dict | None = None
    """From a KV connector as the request ends (a prefill instance's handle on the staged prompt)."""
    error_status: int | None = None
    """With `error`: the HTTP status the server answers with when the request itself is at fault
    (400: its grammar does not compile; 408: its grammar took too long); None: the engine's fault (500)."""
    pooling_output: list[float] | None = None
    """A pooling request's result (it finishes with it): an embedding, class probabilities, a score."""

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


ITERATION_TOKEN_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
"""Upper bounds of the tokens-per-step histogram (kvtide:iteration_tokens_total, as vLLM's)."""


def new_iteration_tokens() -> dict:
    return {"counts": [0] * (len(ITERATION_TOKEN_BUCKETS) + 1), "sum": 0, "count": 0}


def observe_iteration_tokens(histogram: dict, num_tokens: int) -> None:
    histogram["counts"][bisect.bisect_left(ITERATION_TOKEN_BUCKETS, num_tokens)] += 1
    histogram["sum"] += num_tokens
    histogram["count"] += 1


@dataclass
class SchedulerStats:
    num_running: int = 0
    num_waiting: int = 0
    kv_cache_usage: float = 0.0
    num_preemptions: int = 0
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    num_used_blocks: int = 0
    num_evictable_blocks: int = 0
    num_blocks: int = 0
    iteration_tokens: dict = field(default_factory=lambda: new_iteration_tokens())
    """Tokens scheduled per step since start (steps that scheduled any): {"counts": per bucket of
    ITERATION_TOKEN_BUCKETS, non-cumulative, the last one past the top; "sum"; "count"}."""
    max_num_seqs: int = 0
    """The scheduler's limits (--max-num-seqs, the token budget): what utilization is measured against."""
    max_num_batched_tokens: int = 0
    spec_decoding: dict | None = None
    """Speculative decoding counters (spec_decode/metrics.py), None when speculation is off."""
    expert_load: dict | None = None
    """MoE models: assignments per sparse layer and expert so far, and those the capacity cap
    skipped (engine/expert_load.py); None for dense models."""
    structured_output: dict | None = None
    """Structured output counters and recent compile times (structured_output/manager.py), None
    before the first constrained request."""
    kv_connector: dict | None = None
    """KV connector counters (disagg/base.py ConnectorStats), None without a connector."""
    lora: dict | None = None
    """LoRA adapters: requests per adapter running and waiting, the resident ones, load times
    (lora/stats.py); None with LoRA off."""
    memory: dict | None = None
    """Bytes by kind measured at startup (worker/memory_budget.py KINDS, plus "resident"), None
    where the engine did not measure them."""
    extra: dict = field(default_factory=dict)
