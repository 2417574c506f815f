"""The engine's logits processors and the batch index each running request holds among them.

The runner's persistent batch (worker/input_batch.py) reports each request that takes or leaves a
row; here those reports become vLLM's BatchUpdate: a request leaving frees its index, one arriving
takes the lowest free index, and indices left free past them are filled by moving the last request
down (UNIDIRECTIONAL), so the batch's indices stay 0..batch_size-1. A step's sampling rows come in
the runner's order (decodes first); the logits reach the processors scattered into batch-index
order, and go back in the runner's.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from kvtide.logits_processors.interface import AddedRequest, BatchUpdate, LogitsProcessor, MoveDirectionality


class OutputTokens(Sequence[int]):
    """A live view of a request's output token ids (its record's tokens past the prompt): what a
    processor reads stays current as the request generates."""

    def __init__(self, state: Any) -> None:
        self._state = state

    def __len__(self) -> int:
        return len(self._state.token_ids) - self._state.num_prompt_tokens

    def __getitem__(self, index):  # type: ignore[override]
        tokens, start = self._state.token_ids, self._state.num_prompt_tokens
        if isinstance(index, slice):
            return tokens[start:][index]
        if index < 0:
            index += len(self)
        if not 0 <= index < len(self):
            raise IndexError(index)
        return tokens[start + index]

    def __iter__(self):
        return iter(self._state.token_ids[self._state.num_prompt_tokens:])

    def __eq__(self, other: object) -> bool:
        return list(self) == list(other) if isinstance(other, Sequence) else NotImplemented


class LogitsProcessorBatch:
    """Built once per runner; the persistent batch calls `request_added` / `request_removed` as
    its rows change, and each sampling step calls `step` with its requests in logits order."""

    def __init__(self, processors: list[LogitsProcessor]) -> None:
        self.processors = processors
        self.before_penalties = [p for p in processors if not p.is_argmax_invariant()]
        self.after_temperature = [p for p in processors if p.is_argmax_invariant()]
        self.index_of: dict[str, int] = {}
        self._at: list[str | None] = []
        """Request id at each batch index (None: freed since the last update)."""
        self._pending: dict[str, Any] = {}
        """Requests arrived since the last update, by id (their records)."""
        self._removed: list[int] = []

    # ---- row changes (worker/input_batch.py's RowListener) -----------------------------------
    def request_added(self, state: Any) -> None:
        self._pending[state.request_id] = state

    def request_removed(self, request_id: str) -> None:
        if self._pending.pop(request_id, None) is not None:
            return  # arrived and left between two updates: the processors never saw it
        index = self.index_of.pop(request_id, None)
        if index is not None:
            self._at[index] = None
            self._removed.append(index)

    def _batch_update(self) -> BatchUpdate | None:
        if not self._pending and not self._removed:
            return None
        free = sorted(i for i, r in enumerate(self._at) if r is None)
        added: list[AddedRequest] = []
        for request_id, state in self._pending.items():
            index = free.pop(0) if free else len(self._at)
            if index == len(self._at):
                self._at.append(None)
            self._at[index] = request_id
            self.index_of[request_id] = index
            added.append((index, state.sampling_params, list(state.token_ids[:state.num_prompt_tokens]),
                          OutputTokens(state)))
        moved = []
        while self._at and self._at[-1] is None:
            self._at.pop()
        for hole in free:  # the last request fills each remaining hole below it
            if hole >= len(self._at):
                break
            last = len(self._at) - 1
            request_id = self._at.pop()
            self._at[hole] = request_id
            self.index_of[request_id] = hole  # type: ignore[index]
            moved.append((last, hole, MoveDirectionality.UNIDIRECTIONAL))
            while self._at and self._at[-1] is None:
                self._at.pop()
        update = BatchUpdate(len(self._at), list(self._removed), added, moved)
        self._pending, self._removed = {}, []
        return update

    # ---- a step ------------------------------------------------------------------------------
    def step(self, states: Sequence[Any]) -> LogitsProcessorStep:
        """Bring every processor up to date and return how to apply them to this step's logits
        (row i: `states[i]`)."""
        update = self._batch_update()
        for processor in self.processors:
            processor.update_state(update)
        return LogitsProcessorStep(self, [self.index_of[s.request_id] for s in states], len(self._at))


class LogitsProcessorStep:
    """One step's processors, applied by the sampler (sampling/sampler.py) at their two places."""

    def __init__(self, batch: LogitsProcessorBatch, indices: list[int], batch_size: int) -> None:
        self.batch = batch
        self.indices = indices
        self.batch_size = batch_size
        self._identity = indices == list(range(batch_size))

    def apply(self, logits: torch.Tensor, argmax_invariant: bool) -> torch.Tensor:
        processors = self.batch.after_temperature if argmax_invariant else self.batch.before_penalties
        if not processors:
            return logits
        if self._identity:
            full = logits
        else:  # rows of requests not sampling this step are zeros nobody reads
            full = logits.new_zeros(self.batch_size, logits.shape[1])
            full[self.indices] = logits
        for processor in processors:
            full = processor.apply(full)
        return full if self._identity else full[self.indices]
