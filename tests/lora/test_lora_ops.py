"""The batched LoRA op against a float64 row-by-row reference: adapters of ranks 8, 16 and 64 in
slots padded to the largest rank, fused shards (q|k|v sizes), base rows, empty slots, and every row
on one adapter."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kvtide.lora.ops import add_lora, group_tokens_by_slot

IN, MAX_RANK = 48, 64
SHARDS = [(0, 32), (32, 16), (48, 16)]  # q, k, v output rows
OUT = 64


def random_slots(ranks: list[int], seed: int) -> tuple[torch.Tensor, torch.Tensor, list[list[tuple]]]:
    """Slot tensors in the op's layout, and per slot, per shard, the (A, B) they hold (float64)."""
    g = torch.Generator().manual_seed(seed)
    lora_a = torch.zeros(len(ranks), len(SHARDS) * MAX_RANK, IN, dtype=torch.float64)
    lora_b = torch.zeros(len(ranks), OUT, MAX_RANK, dtype=torch.float64)
    held = []
    for slot, rank in enumerate(ranks):
        shards = []
        for i, (offset, size) in enumerate(SHARDS):
            a = torch.randn(rank, IN, generator=g, dtype=torch.float64)
            b = torch.randn(size, rank, generator=g, dtype=torch.float64) * 0.3
            lora_a[slot, i * MAX_RANK:i * MAX_RANK + rank] = a
            lora_b[slot, offset:offset + size, :rank] = b
            shards.append((a, b))
        held.append(shards)
    return lora_a, lora_b, held


def reference(y: torch.Tensor, x: torch.Tensor, token_slots: np.ndarray, held) -> torch.Tensor:
    out = y.clone()
    for t, slot in enumerate(token_slots.tolist()):
        if slot < 0:
            continue
        for (offset, size), (a, b) in zip(SHARDS, held[slot], strict=True):
            out[t, offset:offset + size] += b @ (a @ x[t])
    return out


@pytest.mark.parametrize("token_slots", [
    [0, -1, 2, 1, 0, 2, -1, -1, 1, 0],  # three ranks and base rows interleaved
    [2, 2, 2, 2, 2],                    # every row on one adapter (rank 64)
    [-1, 1, -1, 1],                     # slots 0 and 2 hold adapters no row uses (empty groups)
    [0],                                # one decode row
], ids=["mixed", "one-adapter", "empty-groups", "single-row"])
def test_add_lora_matches_float64_reference(token_slots):
    slots = np.array(token_slots, dtype=np.int64)
    lora_a, lora_b, held = random_slots([8, 16, 64], seed=len(token_slots))
    g = torch.Generator().manual_seed(99)
    x = torch.randn(len(slots), IN, generator=g, dtype=torch.float64)
    y = torch.randn(len(slots), OUT, generator=g, dtype=torch.float64)
    groups = group_tokens_by_slot(slots, torch.device("cpu"))
    got = add_lora(y, x, lora_a, lora_b, groups, SHARDS)
    torch.testing.assert_close(got, reference(y, x, slots, held), rtol=1e-12, atol=1e-12)
    assert not torch.equal(got, y)


def test_grouping_sorts_by_slot_and_drops_base_rows():
    groups = group_tokens_by_slot(np.array([2, -1, 0, 2, 0]), torch.device("cpu"))
    assert groups.perm.tolist() == [2, 4, 0, 3]
    assert groups.segments == [(0, 0, 2), (2, 2, 4)]
    assert group_tokens_by_slot(np.array([-1, -1]), torch.device("cpu")) is None


def test_float32_op_is_close_to_float64():
    slots = np.array([1, 0, -1, 2, 1], dtype=np.int64)
    lora_a, lora_b, held = random_slots([8, 16, 64], seed=5)
    g = torch.Generator().manual_seed(3)
    x = torch.randn(len(slots), IN, generator=g, dtype=torch.float64)
    y = torch.zeros(len(slots), OUT, dtype=torch.float64)
    groups = group_tokens_by_slot(slots, torch.device("cpu"))
    got = add_lora(y.float(), x.float(), lora_a.float(), lora_b.float(), groups, SHARDS)
    torch.testing.assert_close(got.double(), reference(y, x, slots, held), rtol=1e-4, atol=1e-4)
