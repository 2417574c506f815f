"""The score drop policy's choice of blocks, on hand-built masses (the engine end to end is
tests/kv_compression/test_score_dropping.py)."""

from __future__ import annotations

import torch
from paged_batches import make_paged_batch

from kvtide.attention.torch_ref import TorchReferenceBackend
from kvtide.kv_compression.attention_mass import accumulate_attention_mass
from kvtide.kv_compression.score_dropping import blocks_to_drop


def test_within_budget_nothing_is_dropped():
    assert blocks_to_drop([5.0] * 4, [True] * 4, num_computed=64, block_size=16, budget=1.0) == []
    assert blocks_to_drop([5.0] * 4, [True, False, True, True], num_computed=64, block_size=16, budget=0.75) == []


def test_lowest_mass_goes_first_sink_and_recent_blocks_stay():
    # 10 blocks (150 tokens), budget 0.5 -> keep 5: block 0 and the last 5 // 2 = 2 live blocks are
    # protected, whatever their mass; the 5 lowest of blocks 1..7 go
    mass = [0.1, 9.0, 0.5, 7.0, 0.2, 8.0, 0.3, 6.0, 0.0, 0.0]
    drop = blocks_to_drop(mass, [True] * 10, num_computed=150, block_size=16, budget=0.5)
    assert drop == [2, 3, 4, 6, 7]
    assert [b for b in range(10) if b not in drop] == [0, 1, 5, 8, 9]


def test_ties_go_to_the_earlier_block_and_dropped_blocks_stay_dropped():
    drop = blocks_to_drop([1.0] * 8, [True] * 8, num_computed=128, block_size=16, budget=0.5)
    assert drop == [1, 2, 3, 4]  # keep 4: 0, then 6 and 7 recent; of 1..5 the earliest four go
    live = [b not in drop for b in range(8)] + [True]
    # one more block (keep ceil(4.5) = 5 of 9): within budget, and block 5 stays
    assert blocks_to_drop([1.0] * 9, live, num_computed=130, block_size=16, budget=0.5) == []


def test_attention_mass_sums_the_softmax_weights_per_block():
    """Every query's weights sum to 1 per head: the step's total mass is queries x heads, spread
    over the blocks exactly as a dense softmax spreads it."""
    batch = make_paged_batch([(1, 40), (5, 20)], 4, 2, 16, 16, torch.float32, seed=0)
    backend = TorchReferenceBackend()
    cache = batch.kv_cache.clone()
    backend.write_kv(batch.key, batch.value, cache, batch.metadata.slot_mapping)
    acc = torch.zeros(batch.metadata.block_tables.shape)
    accumulate_attention_mass(acc, batch.query, cache, batch.metadata, backend, 0.25, None, 0, None)
    assert torch.allclose(acc.sum(dim=1), torch.tensor([1.0 * 4, 5.0 * 4]), atol=1e-5)
    # the decode row against a dense softmax over its 41 keys
    md = batch.metadata
    slots = [int(md.block_tables[0, j // 16]) * 16 + j % 16 for j in range(41)]
    key = cache.view(2, -1, 2, 16)[0, slots].repeat_interleave(2, dim=1)
    probs = (torch.einsum("hd,khd->hk", batch.query[0], key) * 0.25).softmax(-1).sum(0)
    expected = torch.nn.functional.pad(probs, (0, 48 - 41)).view(3, 16).sum(-1)
    assert torch.allclose(acc[0, :3], expected, atol=1e-5)
