"""The batched LoRA op: every row adds scale * B_a (A_a x) of its own adapter `a`, rows grouped by
adapter slot (shrink to the rank, then expand), one pair of matmuls per adapter in the step.

    token slots  [2, -1, 0, 2, 0]          (-1: the base model, nothing added)
    perm         [2, 4, 0, 3]              tokens sorted by slot (stable), base tokens left out
    segments     [(0, 0, 2), (2, 2, 4)]    (slot, start, end) into perm

A fused linear (q|k|v, gate|up) holds one adapter per shard: its slot's A stacks the shards' A
along the rank, (num_shards * R, in), and its B keeps each shard's rows where the shard's output
rows are, (out, R); shard i's expand reads shrink columns [i R, (i + 1) R). Ranks below the slots'
R are zero-padded, so adapters of any rank share one layout. The scale is folded into B at load.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch


@dataclass
class LoRAStepGroups:
    """One step's rows grouped by adapter slot (see the module docstring)."""

    num_tokens: int
    perm: torch.Tensor
    """(num_lora_tokens,) int64: token indices sorted by slot, base-model tokens left out."""
    segments: list[tuple[int, int, int]]
    """(slot, start, end): perm[start:end] are the tokens of `slot`, each slot once, in slot order."""


def group_tokens_by_slot(token_slots: np.ndarray, device: torch.device) -> LoRAStepGroups | None:
    """The step's groups from each token's slot (-1: base model); None when no token has an adapter."""
    lora_tokens = np.nonzero(token_slots >= 0)[0]
    if not len(lora_tokens):
        return None
    order = np.argsort(token_slots[lora_tokens], kind="stable")
    perm = lora_tokens[order]
    slots = token_slots[perm]
    bounds = np.flatnonzero(np.diff(slots)) + 1
    starts = np.concatenate(([0], bounds))
    ends = np.concatenate((bounds, [len(perm)]))
    segments = [(int(slots[s]), int(s), int(e)) for s, e in zip(starts, ends, strict=True)]
    return LoRAStepGroups(len(token_slots), torch.from_numpy(perm).to(device), segments)


def add_lora(y: torch.Tensor, x: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor,
             groups: LoRAStepGroups, out_slices: list[tuple[int, int]]) -> torch.Tensor:
    """y + the LoRA delta of every grouped token. y: (T, out); x: (T, in); lora_a: (slots,
    num_shards * R, in); lora_b: (slots, out, R) with the scale folded in; out_slices: (offset, size)
    of each shard's output rows, in shard order. Returns a new tensor (y is left as it is)."""
    rank = lora_b.shape[-1]
    xs = x.index_select(0, groups.perm)  # (N, in), grouped by slot
    delta = torch.zeros(xs.shape[0], y.shape[1], dtype=y.dtype, device=y.device)
    for slot, start, end in groups.segments:
        shrunk = xs[start:end] @ lora_a[slot].T  # (n, num_shards * R)
        for i, (offset, size) in enumerate(out_slices):
            delta[start:end, offset:offset + size] = shrunk[:, i * rank:(i + 1) * rank] @ \
                lora_b[slot, offset:offset + size].T
    return y.index_add(0, groups.perm, delta)
