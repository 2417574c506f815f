"""Request: the scheduler's view of one sequence being generated."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

from kvtide.lora.request import LoRARequest
from kvtide.pooling.params import PoolingParams
from kvtide.sampling_params import SamplingParams


class RequestStatus(enum.IntEnum):
    WAITING = 0
    RUNNING = 1
    PREEMPTED = 2
    # Terminal states come after this line.
    FINISHED_STOPPED = 3
    FINISHED_LENGTH = 4
    FINISHED_ABORTED = 5

    @property
    def finished(self) -> bool:
        return self >= RequestStatus.FINISHED_STOPPED

    @property
    def finish_reason(self) -> str | None:
        return {RequestStatus.FINISHED_STOPPED: "stop", RequestStatus.FINISHED_LENGTH: "length",
                RequestStatus.FINISHED_ABORTED: "abort"}.get(self)


@dataclass
class EngineCoreRequest:
    """A validated request as it crosses into the engine core (in-process or over ZMQ)."""

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_ids: list[int] = field(default_factory=list)
    """The model's end-of-sequence ids (ignored with ignore_eos)."""
    arrival_time: float = field(default_factory=time.time)
    priority: int = 0
    fork_of: str | None = None
    """Engine-core id of a sibling (same user request, same prompt) this one is forked from instead
    of computing the prompt itself: n > 1 and best_of samples share the first sample's prompt
    blocks; the other output slots of a beam search name its root beam."""
    lora_request: LoRARequest | None = None
    """The LoRA adapter this request runs with (None: the base model)."""
    pooling_params: PoolingParams | None = None
    """A pooling model's request (kvtide/pooling/): prefill only; it ends with its pooled output
    once the prompt is computed, and samples nothing."""

    def __post_init__(self) -> None:
        self.lora_request = LoRARequest.from_wire(self.lora_request)  # a dict when it crossed a process boundary


class Request:
    """One sequence: prompt + generated tokens, and how much of it has KV in the cache.

        all_token_ids:  [ prompt ................ | output ........ ]
        num_computed_tokens ──────────────────────────────▲        (KV written)
        num_tokens ───────────────────────────────────────────────▲
    The scheduler hands out `num_tokens - num_computed_tokens` new tokens over one or more steps;
    prefill chunks, decodes and recompute after preemption are all the same thing. It advances
    num_computed_tokens when it schedules a step (the KV is written by the time any later step runs).
    """

    def __init__(self, core_request: EngineCoreRequest) -> None:
        self.request_id = core_request.request_id
        self.sampling_params = core_request.sampling_params
        self.eos_token_ids = frozenset(core_request.eos_token_ids)
        self.arrival_time = core_request.arrival_time
        self.priority = core_request.priority
        self.prompt_token_ids = list(core_request.prompt_token_ids)
        self.num_prompt_tokens = len(self.prompt_token_ids)
        self.output_token_ids: list[int] = []
        self.all_token_ids: list[int] = list(self.prompt_token_ids)
        self.num_computed_tokens = 0
        self.num_output_placeholders = 0
        """Tokens being sampled by steps scheduled but not yet reported: the runner already feeds
        them back (it keeps every sampled token), so the scheduler counts them as known tokens."""
        self.num_cached_tokens = -1
        """Prompt tokens found in the prefix cache at first scheduling (-1: not yet scheduled)."""
        self.status = RequestStatus.WAITING
        self.stop_reason: int | str | None = None
        self.num_preemptions = 0
        self.block_hashes: list[bytes] = []
        self.fork_of = core_request.fork_of
        self.lora_request = core_request.lora_request
        self.pooling_params = core_request.pooling_params
        self.spec_stats = None
        """Speculative decoding: this request's acceptance estimate (spec_decode/policy.py)."""
        self.grammar_future = None
        """Structured output: the compilation of this request's grammar, until it is ready."""
        self.grammar = None
        """Structured output: its RequestGrammar (structured_output/grammar.py) once compiled."""
        self.grammar_error: str | None = None
        self.grammar_error_status = 400
        """The HTTP status of a grammar_error: 400 (the grammar is at fault), 408 (its compile timed out)."""
        self.unsent_token_ids: list[int] = []
        """Tokens appended here that the runner did not sample (jump-forward): sent with the next step."""
        max_tokens = self.sampling_params.max_tokens
        self.max_tokens = max_tokens if max_tokens is not None else 1 << 62

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_tokens_with_placeholders(self) -> int:
        return len(self.all_token_ids) + self.num_output_placeholders

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    def append_output_token(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)

    def is_finished(self) -> bool:
        return self.status.finished

    def sort_key(self) -> tuple[int, float]:
        """Priority order: lower priority value first, then earlier arrival."""
        return (self.priority, self.arrival_time)
