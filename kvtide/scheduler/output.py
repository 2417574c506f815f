"""SchedulerOutput (policy -> execution) and ModelRunnerOutput (execution -> policy).

These two dataclasses are the only contract between the scheduler and the model runner. New
requests go down in full; running ones as diffs (new block ids, how many tokens to compute).

Every field has a concrete type: the plug-ins that ride along (a structured-output grammar, a KV
connector's work and report) are declared here as the small interfaces the other side relies on,
so neither side imports the other's implementation. Both cross process boundaries
(worker/wire.py), so their data is builtins and dataclasses of builtins.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol, TypedDict, runtime_checkable

from kvtide.lora.request import LoRARequest
from kvtide.pooling.params import PoolingParams
from kvtide.sampling_params import SamplingParams

if TYPE_CHECKING:  # annotations only: the scheduler's floor runs without torch
    import torch


@dataclass
class NewRequestData:
    """A request the runner has not seen (or sees again after preemption): everything it needs."""

    request_id: str
    token_ids: list[int]
    """Prompt plus any output generated before a preemption."""
    num_prompt_tokens: int
    """How many of `token_ids` are the prompt (the rest is earlier output)."""
    sampling_params: SamplingParams
    block_ids: list[int]
    """The request's block table so far: block ids in the KV cache pool, in token order."""
    num_computed_tokens: int
    """Tokens whose KV is already in the cache (prefix hit)."""
    num_output_tokens: int = 0
    """Output tokens among `token_ids` (generated before a preemption)."""
    lora_request: LoRARequest | None = None
    """The LoRA adapter the request runs with (None: the base model)."""
    pooling_params: PoolingParams | None = None
    """A pooling request: the runner pools its prompt's hidden states instead of sampling."""


@dataclass
class CachedRequestData:
    """A request the runner holds from an earlier step: only what changed since."""

    request_id: str
    new_block_ids: list[int]
    """Block ids appended to the request's block table this step (the table is append-only)."""
    num_computed_tokens: int
    """Tokens whose KV is in the cache when this step starts."""
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


@runtime_checkable
class GrammarMasker(Protocol):
    """Structured output's part of a step, as the model runner uses it: the grammars of the
    constrained requests sampling this step. Made in the engine core (structured_output/step.py:
    GrammarStep holds the matchers; StepBitmask is its result computed ahead, for the ranks of a
    pipeline)."""

    def check_drafts(self, drafts: dict[str, list[int]], keep: set[str]) -> dict[str, list[int]]:
        """request id -> proposed draft tokens: a constrained request's cut before the first token
        its grammar forbids (those in `keep` stay whole), and omitted when none is left."""
        ...

    def apply(self, logits: torch.Tensor, row_layout: list[tuple[str, int]]) -> None:
        """Mask the forbidden tokens of the constrained rows to -inf, in place. logits:
        (num_rows, vocab_size) float; row_layout: per sampling request in logits order, its id and
        its number of rows (its drafts + 1), summing to num_rows."""
        ...


@dataclass
class KVConnectorMetadata:
    """A KV connector's work for one step, from its scheduler half to its worker half (disagg/):
    each connector's metadata is a dataclass that extends this one."""


@dataclass
class KVConnectorOutput:
    """A KV connector's worker half's report of one step, to its scheduler half (disagg/)."""

    finished_sending: set[str] = field(default_factory=set)
    """Requests whose kept blocks the worker has copied out: the scheduler may free them."""


@dataclass
class SchedulerOutput:
    scheduled_new_reqs: list[NewRequestData]
    scheduled_cached_reqs: list[CachedRequestData]
    num_scheduled_tokens: dict[str, int]
    """request id -> tokens computed this step."""
    total_num_scheduled_tokens: int
    """Sum of `num_scheduled_tokens`: the step's flat batch length."""
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

    kv_connector_metadata: KVConnectorMetadata | None = None
    """The KV connector's work for this step (its worker half reads it), or None without one."""

    grammar: GrammarMasker | None = None
    """Structured output: the grammars of the constrained requests sampling this step, or None
    when there are none."""

    @property
    def is_empty(self) -> bool:
        return self.total_num_scheduled_tokens == 0


@dataclass
class TopLogprobs:
    """Per sampled token: its logprob and rank, and the top-k ids and logprobs."""

    token_logprob: float
    """Natural log of the token's probability."""
    token_rank: int
    """1 + the number of tokens more likely than it (1: the most likely)."""
    top_ids: list[int]
    """The k most likely token ids, most likely first (k: the request's logprobs setting)."""
    top_logprobs: list[float]
    """Their logprobs, aligned with `top_ids`."""


class ExpertLoad(TypedDict):
    """One step's routing of an MoE model, per sparse layer and expert (engine/expert_load.py)."""

    layers: list[int]
    """The sparse layers (decoder layer indices) the rows of `tokens` and `dropped` count."""
    tokens: list[list[int]]
    """(num_sparse_layers, num_experts): token assignments each expert took this step."""
    dropped: list[list[int]]
    """(num_sparse_layers, num_experts): assignments the capacity cap skipped (--moe-capacity-factor)."""


@dataclass
class ModelRunnerOutput:
    sampled_token_ids: dict[str, int]
    """request id -> the token sampled this step (only requests whose prompt is fully computed)."""
    logprobs: dict[str, TopLogprobs] = field(default_factory=dict)
    """request id -> logprobs of its sampled token, for the requests that asked for them."""
    prompt_logprobs: dict[str, list[TopLogprobs]] = field(default_factory=dict)
    """request id -> logprobs of prompt positions 1.. computed this step."""
    failed: dict[str, str] = field(default_factory=dict)
    """request id -> error message; only those requests fail (e.g. non-finite logits)."""
    spec_token_ids: dict[str, list[int]] = field(default_factory=dict)
    """request id -> accepted draft tokens, emitted in order before its sampled token."""
    spec_logprobs: dict[str, list[TopLogprobs | None]] = field(default_factory=dict)
    """request id -> logprobs of each accepted draft token (None entries when not asked)."""
    num_draft_tokens: dict[str, int] = field(default_factory=dict)
    """request id -> drafts the proposer made and the step verified (<= its draft slots)."""
    kv_block_mass: dict[str, list[float]] = field(default_factory=dict)
    """With the score drop policy: request id -> attention mass each of its blocks received this
    step, one entry per block of its context (block index order): the softmax weights of its keys
    in that block, summed over every layer, head and query of the step."""
    kv_connector_output: KVConnectorOutput | None = None
    """A KV connector's report of this step (requests whose kept blocks it copied out), or None."""
    expert_load: ExpertLoad | None = None
    """MoE models: this step's assignments per sparse layer and expert, and those the capacity cap
    skipped; None for dense models."""
    pooler_output: dict[str, list[float]] = field(default_factory=dict)
    """Pooling models: request id -> its pooled output (an embedding, class probabilities, a score),
    for the requests whose prompt this step finished; they end with it."""
