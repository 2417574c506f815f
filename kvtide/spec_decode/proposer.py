"""The proposer interface: what every speculative method reads of the batch, and the hooks it gets.

One class per method (spec_decode/registry.py names them); SpecDecodeWorker calls them, the model
runner never does. A step, seen from a proposer:

    propose(ProposerInput)      before the target's forward pass: up to k drafts per request that
                                the scheduler gave k draft slots
    draft_distribution(req_id)  during verification: the rows q its drafts were drawn from, when it
                                sampled them (verified by rejection sampling against q), else None
    observe(TargetStep)         after every forward pass of the target (sampling or not, on its
                                last pipeline stage): what the method keeps of the step (hidden
                                states, accepted runs)
    forget(request_ids)         the requests finished: drop what is kept of them

Model-based methods also name their attention layers (they get KV caches beside the target's,
in the same block tables) and capture decode CUDA graphs once those caches are bound.

Proposers read requests through RequestView only, never through the runner's own types, so the
runner may keep its request state however it likes (CachedRequestState satisfies the view as is).
"""

from __future__ import annotations

import abc
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, NamedTuple, Protocol

import torch

from kvtide.config import EngineConfig
from kvtide.sampling_params import SamplingParams

if TYPE_CHECKING:  # the n-gram method, in the engine core under pipeline parallelism, needs no step tensors
    from kvtide.worker.input_batch import StepInputs


class RequestView(Protocol):
    """One request as a proposer may read it, read-only (the runner owns it and its lists).

        token_ids            [p0 .. p_{P-1} | o0 .. o_{n-1}]   prompt (num_prompt_tokens), then output
                                                      ^ x, the last token: drafts continue it
        num_computed_tokens  tokens whose target KV is written; when proposing, x sits at this
                             position (len(token_ids) == num_computed_tokens + 1)
    """

    @property
    def request_id(self) -> str: ...

    @property
    def uid(self) -> int:
        """Fresh each time the runner (re)receives the request in full (new, preempted and resumed,
        forked): what a proposer kept under an older uid is stale."""

    @property
    def token_ids(self) -> list[int]:
        """Never mutated by a proposer: slices of it are its own copies."""

    @property
    def num_prompt_tokens(self) -> int: ...

    @property
    def num_computed_tokens(self) -> int: ...

    @property
    def block_ids(self) -> Sequence[int]:
        """The request's block table in the target's KV cache (a draft's own cache uses the same
        block ids); -1 where a block was dropped."""

    @property
    def sampling_params(self) -> SamplingParams: ...


class DraftSlots(NamedTuple):
    request: RequestView
    num_slots: int
    """k >= 1: the most drafts the target verifies for this request this step; a proposer may
    fill fewer (the empty slots are not computed)."""


@dataclass(frozen=True)
class ProposerInput:
    """The requests given draft slots this step, in the scheduler's order."""

    rows: Sequence[DraftSlots]


@dataclass(frozen=True)
class TargetStep:
    """What the target computed in one step, after verification (read-only).

    `inputs` is the target's own step (StepInputs): proposers read its `order` (request ids in
    batch order), `sample_rows`, `logits_indices` ((num_logits,), per sampling request its last
    known token and each draft) and `metadata.query_start_loc_cpu` ((num_reqs + 1,), where each
    request's tokens start in the flat batch). A request's row computed its scheduled tokens,
    its drafts last.
    """

    inputs: StepInputs
    hidden: torch.Tensor
    """(num_tokens, hidden) the target's final hidden states (after its final norm, the LM head's
    input), one row per token of `inputs`."""
    requests: Mapping[str, RequestView]
    """Every request of inputs.order; a sampling request's token_ids already end with what it
    emitted (its num_computed_tokens is still the step's start)."""
    drafts: Mapping[str, list[int]]
    """The drafts the step verified (after the grammar's cut and the TP group's agreement)."""
    emitted: Mapping[str, list[int]]
    """Per sampling request: its accepted drafts, then the token the target drew after them; []
    when its row failed. Requests that did not sample this step are absent."""


class Proposer(abc.ABC):
    """A speculative method. Subclasses implement from_config and propose; the hooks default to
    nothing, for methods that keep no state and own no model."""

    @classmethod
    @abc.abstractmethod
    def from_config(cls, config: EngineConfig, target: torch.nn.Module, device: torch.device) -> Proposer:
        """Build the method for `target` (its draft model or heads loaded, on `device`). Errors in
        the user's configuration that only the loaded models reveal are ValueErrors here."""

    @abc.abstractmethod
    def propose(self, batch: ProposerInput) -> dict[str, list[int]]:
        """Drafts per request id, at most num_slots each; a request may be absent or get []."""

    def draft_distribution(self, request_id: str) -> list[torch.Tensor] | None:
        """The last propose's draft distributions of a request whose drafts were sampled: one
        (vocab,) probability row per draft, the q that rejection sampling verifies against. None
        when its drafts were proposed deterministically (verified by matching)."""
        return None

    def observe(self, step: TargetStep) -> None:
        """After every forward pass of the target that reached its last layer (the last pipeline
        stage), verification done."""
        return None  # nothing to keep

    def forget(self, request_ids: set[str]) -> None:
        """The requests finished (or were aborted): drop what is kept of them."""
        return None  # nothing to keep

    def attention_layers(self) -> list:
        """The method's own attention layers, given KV caches after the target's."""
        return []

    def capture_graphs(self, config: EngineConfig) -> None:
        """After the KV caches are bound: capture the method's decode CUDA graphs, if it has any."""
        return None  # no graphs
