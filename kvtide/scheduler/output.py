"""SchedulerOutput (policy -> execution) and ModelRunnerOutput (execution -> policy).

These two dataclasses are the only contract between the scheduler and the model runner. New
requests go down in full; running ones as diffs (new block ids, how many tokens to compute).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from kvtide.sampling_params import SamplingParams


@dataclass
class NewRequestData:
    """A request the runner has not seen (or sees again after preemption): everything it needs."""

    request_id: str
    token_ids: list[int]
    """Prompt plus any output generated before a preemption."""
    num_prompt_tokens: int
    sampling_params: SamplingParams
    block_ids: list[int]
    num_computed_tokens: int
    """Tokens whose KV is already in the cache (prefix hit)."""
    num_output_tokens: int = 0


@dataclass
class CachedRequestData:
    request_id: str
    new_block_ids: list[int]
    num_computed_tokens: int
    new_token_ids: list[int] = field(default_factory=list)
    """Tokens the scheduler appended that the runner did not sample (structured output's
    jump-forward): the runner appends them before computing this step."""
    dropped_block_indices: list[int] = field(default_factory=list)
    """Indices into the request's block table of blocks the KV drop policy removed since the last
    step: the runner marks them -1, which no query attends."""
    sampled_token_ids: list[int] = field(default_factory=list)
    """Tokens sampled since this rank last saw the request by a rank that is not this one (the last
    pipeline stage): appended before `new_token_ids`. Filled by the executor for the ranks of
    earlier stages; empty for the rank that sampled them."""


@dataclass
class SchedulerOutput:
    scheduled_new_reqs: list[NewRequestData]
    scheduled_cached_reqs: list[CachedRequestData]
    num_scheduled_tokens: dict[str, int]
    """request id -> tokens computed this step."""
    total_num_scheduled_tokens: int
    finished_req_ids: set[str] = field(default_factory=set)
    """Requests that ended or were preempted since the last step: the runner drops their state."""
    block_copies: list[tuple[int, int]] = field(default_factory=list)
    """(src, dst) block ids: copy each src block to dst in every layer's KV cache before the
    forward (copy-on-write of a block shared after a fork)."""
    num_computed_before: dict[str, int] = field(default_factory=dict)
    """request id -> its computed tokens when this step was scheduled (where the step starts), for
    the requests that asked for prompt logprobs (their positions are counted from there)."""
    sampling_req_ids: set[str] = field(default_factory=set)
    """Requests this step reaches the end of (the runner samples their next token)."""
    num_draft_tokens: dict[str, int] = field(default_factory=dict)
    """request id -> draft slots among its scheduled tokens: the runner proposes up to that many
    drafts after the request's last token and verifies them in this step."""

    kv_connector_metadata: Any = None
    """The KV connector's work for this step (its worker half reads it), or None."""

    grammar: Any = None
    """Structured output: a GrammarStep (structured_output/step.py) with the matchers of the
    constrained requests sampling this step, or None when there are none."""

    @property
    def is_empty(self) -> bool:
        return self.total_num_scheduled_tokens == 0


@dataclass
class TopLogprobs:
    """Per sampled token: its logprob and rank, and the top-k ids and logprobs."""

    token_logprob: float
    token_rank: int
    top_ids: list[int]
    top_logprobs: list[float]


@dataclass
class ModelRunnerOutput:
    sampled_token_ids: dict[str, int]
    """request id -> the token sampled this step (only requests whose prompt is fully computed)."""
    logprobs: dict[str, TopLogprobs] = field(default_factory=dict)
    prompt_logprobs: dict[str, list[TopLogprobs]] = field(default_factory=dict)
    """request id -> logprobs of prompt positions 1.. computed this step."""
    failed: dict[str, str] = field(default_factory=dict)
    """request id -> error; only those requests fail (e.g. non-finite logits)."""
    spec_token_ids: dict[str, list[int]] = field(default_factory=dict)
    """request id -> accepted draft tokens, emitted in order before its sampled token."""
    spec_logprobs: dict[str, list[TopLogprobs | None]] = field(default_factory=dict)
    """request id -> logprobs of each accepted draft token (None entries when not asked)."""
    num_draft_tokens: dict[str, int] = field(default_factory=dict)
    """request id -> drafts the proposer made and the step verified (<= its draft slots)."""
    kv_block_mass: dict[str, list[float]] = field(default_factory=dict)
    """With the score drop policy: request id -> attention mass each of its blocks received this
    step (per block index, over every layer, head and query of the step)."""
    kv_connector_output: Any = None
    """A KV connector's KVConnectorOutput (disagg/base.py): requests whose kept blocks it copied out."""
    expert_load: dict | None = None
    """MoE models: this step's assignments per sparse layer and expert, and those the capacity cap
    skipped ({"layers", "tokens", "dropped"}; engine/expert_load.py); None for dense models."""
