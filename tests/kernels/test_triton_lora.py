"""The Triton LoRA kernels (segmented shrink and expand) equal a float64 row-by-row reference and
the torch op: adapters of ranks 8, 16 and 64 padded to one slot rank, fused shards, base rows,
empty slots, every row on one adapter, segments longer than a row block."""

from __future__ import annotations

import numpy as np
import pytest
import torch

pytest.importorskip("triton")

from kvtide.lora.ops import add_lora, group_tokens_by_slot  # noqa: E402
from kvtide.lora.triton_ops import add_lora_triton  # noqa: E402

pytestmark = pytest.mark.triton

IN, MAX_RANK, OUT = 40, 64, 80
SHARDS = [(0, 48), (48, 16), (64, 16)]  # q, k, v output rows (k and v narrower than a block)
LAYOUTS = {
    "mixed": [0, -1, 2, 1, 0, 2, -1, -1, 1, 0] * 3,  # segments past one 16-row block
    "one-adapter": [2] * 5,
    "empty-groups": [-1, 1, -1, 1],
    "single-row": [0],
}


def random_slots(ranks: list[int], seed: int):
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


def reference(y, x, token_slots, held):
    out = y.clone()
    for t, slot in enumerate(token_slots.tolist()):
        if slot >= 0:
            for (offset, size), (a, b) in zip(SHARDS, held[slot], strict=True):
                out[t, offset:offset + size] += b @ (a @ x[t])
    return out


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_triton_lora_matches_float64_reference(device, layout):
    slots = np.array(LAYOUTS[layout], dtype=np.int64)
    lora_a, lora_b, held = random_slots([8, 16, 64], seed=len(slots))
    g = torch.Generator().manual_seed(7)
    x = torch.randn(len(slots), IN, generator=g, dtype=torch.float64)
    y = torch.randn(len(slots), OUT, generator=g, dtype=torch.float64)
    groups = group_tokens_by_slot(slots, device)
    got = add_lora_triton(y.float().to(device), x.float().to(device), lora_a.float().to(device),
                          lora_b.float().to(device), groups, SHARDS)
    torch.testing.assert_close(got.double().cpu(), reference(y, x, slots, held), rtol=1e-4, atol=1e-4)


def test_triton_lora_bf16_matches_the_torch_op(device, close):
    slots = np.array(LAYOUTS["mixed"], dtype=np.int64)
    lora_a, lora_b, _ = random_slots([8, 16, 64], seed=3)
    g = torch.Generator().manual_seed(8)
    x = torch.randn(len(slots), IN, generator=g).to(torch.bfloat16)
    y = torch.randn(len(slots), OUT, generator=g).to(torch.bfloat16)
    groups = group_tokens_by_slot(slots, device)
    args = (lora_a.to(torch.bfloat16), lora_b.to(torch.bfloat16))
    expected = add_lora(y.float(), x.float(), args[0].float(), args[1].float(), groups, SHARDS)
    got = add_lora_triton(y.to(device), x.to(device), args[0].to(device), args[1].to(device), groups, SHARDS)
    assert got.dtype == torch.bfloat16
    close(got, expected, torch.bfloat16)
