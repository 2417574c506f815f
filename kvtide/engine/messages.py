"""Messages the engine core emits per step. Plain dataclasses of builtins, so they serialize with
msgspec across the ZMQ channel without pickle."""

from __future__ import annotations

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

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


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
    step_tokens: int = 0
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
    extra: dict = field(default_factory=dict)
