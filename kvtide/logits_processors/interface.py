"""The logits-processor interface: what a processor implements, and the batch changes it is told.

A processor is built once per engine and sees the whole batch. It keeps per-request state by batch
index: each step, before `apply`, `update_state` gets the indices that changed since the last step,
to be handled in this order: `removed` (the index is now empty), `added` (a request takes the index,
replacing whatever was there), `moved` (a request changes index: UNIDIRECTIONAL leaves the source
empty, SWAP exchanges two). `apply` then gets the logits (batch_size, vocab): row i is the request
at index i.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from enum import Enum
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

    from kvtide.sampling_params import SamplingParams


class MoveDirectionality(Enum):
    UNIDIRECTIONAL = 0
    """The request at the source moves to the destination; the source is left empty."""
    SWAP = 1
    """The requests at the two indices exchange places."""


AddedRequest = tuple[int, "SamplingParams", list[int], Sequence[int]]
"""(index, sampling params, prompt token ids, output token ids): the output ids are a live view
that grows as the request generates."""
RemovedRequest = int
MovedRequest = tuple[int, int, MoveDirectionality]
"""(source index, destination index, directionality)."""


@dataclass(frozen=True)
class BatchUpdate:
    batch_size: int
    """Requests in the batch after the update (indices 0..batch_size-1 are taken)."""
    removed: Sequence[RemovedRequest]
    added: Sequence[AddedRequest]
    moved: Sequence[MovedRequest]


class LogitsProcessor(ABC):
    """Subclass, implement the four methods, and load it with `--logits-processors module:Class`
    or `LLM(logits_processors=[Class])`. Per-request arguments reach it in
    `SamplingParams.extra_args` (the server's `vllm_xargs`)."""

    @classmethod
    def validate_params(cls, sampling_params: SamplingParams) -> None:
        """Raise ValueError for a request whose arguments this processor refuses (called before
        the request is queued). Accepts every request unless overridden."""
        return None

    @abstractmethod
    def __init__(self, config: Any, device: torch.device, is_pin_memory: bool) -> None:
        """`config`: the engine's EngineConfig; `device`: where the logits live."""

    @abstractmethod
    def is_argmax_invariant(self) -> bool:
        """True if the processor never changes a row's argmax (it then runs after temperature
        and is skipped for greedy rows); False runs it before penalties, on every row."""

    @abstractmethod
    def update_state(self, batch_update: BatchUpdate | None) -> None:
        """The batch's changes since the last step (None: none). Called every step, before apply."""

    @abstractmethod
    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        """Return the processed logits (in place or a new tensor)."""
