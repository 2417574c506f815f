"""Example processors, each switched on per request through SamplingParams.extra_args:

    TokenBanLogitsProcessor       {"banned_token_ids": [ids]}: those tokens are never sampled
    NoRepeatNGramLogitsProcessor  {"no_repeat_ngram_size": n}: no n-gram of the prompt and output
                                  occurs twice (transformers' no_repeat_ngram_size)

Load them like any other: `--logits-processors kvtide.logits_processors.builtin:TokenBanLogitsProcessor`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from kvtide.logits_processors.interface import BatchUpdate, LogitsProcessor, MoveDirectionality


def apply_batch_update(per_index: dict[int, Any], update: BatchUpdate | None, state_of) -> None:
    """Keep a {batch index: state} map in step with the batch: `state_of(added request)` gives the
    state of a newcomer (None: the processor does not apply to it)."""
    if update is None:
        return
    for index in update.removed:
        per_index.pop(index, None)
    for added in update.added:
        state = state_of(added)
        if state is None:
            per_index.pop(added[0], None)
        else:
            per_index[added[0]] = state
    for source, destination, direction in update.moved:
        moving = per_index.pop(source, None)
        if direction == MoveDirectionality.SWAP:
            other = per_index.pop(destination, None)
            if other is not None:
                per_index[source] = other
        else:
            per_index.pop(destination, None)
        if moving is not None:
            per_index[destination] = moving


def _extra_arg(params, name: str) -> Any:
    return (params.extra_args or {}).get(name)


class TokenBanLogitsProcessor(LogitsProcessor):
    """Masks each request's `banned_token_ids` (as a logit_bias of -inf would)."""

    @classmethod
    def validate_params(cls, sampling_params) -> None:
        ids = _extra_arg(sampling_params, "banned_token_ids")
        if ids is not None and (not isinstance(ids, list) or any(
                not isinstance(t, int) or isinstance(t, bool) or t < 0 for t in ids)):
            raise ValueError(f"extra_args.banned_token_ids must be a list of token ids >= 0, got {ids!r}")

    def __init__(self, config: Any, device: torch.device, is_pin_memory: bool) -> None:
        self.banned: dict[int, list[int]] = {}

    def is_argmax_invariant(self) -> bool:
        return False

    def update_state(self, batch_update: BatchUpdate | None) -> None:
        apply_batch_update(self.banned, batch_update,
                           lambda added: _extra_arg(added[1], "banned_token_ids") or None)

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        vocab_size = logits.shape[1]
        for index, ids in self.banned.items():
            ids = [t for t in ids if t < vocab_size]
            if ids:
                logits[index, ids] = float("-inf")
        return logits


class NoRepeatNGramLogitsProcessor(LogitsProcessor):
    """Bans every token that would repeat an n-gram already in the request's prompt + output."""

    @classmethod
    def validate_params(cls, sampling_params) -> None:
        n = _extra_arg(sampling_params, "no_repeat_ngram_size")
        if n is not None and (not isinstance(n, int) or isinstance(n, bool) or n < 1):
            raise ValueError(f"extra_args.no_repeat_ngram_size must be an integer >= 1, got {n!r}")

    def __init__(self, config: Any, device: torch.device, is_pin_memory: bool) -> None:
        self.requests: dict[int, tuple[int, list[int], Sequence[int]]] = {}
        """batch index -> (n, prompt ids, live output ids)."""

    def is_argmax_invariant(self) -> bool:
        return False

    def update_state(self, batch_update: BatchUpdate | None) -> None:
        def state_of(added):
            n = _extra_arg(added[1], "no_repeat_ngram_size")
            return None if n is None else (n, added[2], added[3])

        apply_batch_update(self.requests, batch_update, state_of)

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        for index, (n, prompt, output) in self.requests.items():
            banned = repeated_ngram_completions(prompt + list(output), n)
            if banned:
                logits[index, banned] = float("-inf")
        return logits


def repeated_ngram_completions(tokens: list[int], n: int) -> list[int]:
    """Tokens that, appended to `tokens`, would repeat an n-gram already in them."""
    if len(tokens) < n:
        return []
    if n == 1:
        return sorted(set(tokens))
    tail = tokens[len(tokens) - n + 1:]
    return sorted({tokens[i + n - 1] for i in range(len(tokens) - n + 1) if tokens[i:i + n - 1] == tail})
