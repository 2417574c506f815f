"""The fast torch backend (head-major cache, batched decode) equals the reference backend
(torch_ref.py) on random paged batches: mixed decode/prefill, cached prefixes, odd lengths, block
edges, GQA ratios 1/4/8, sliding windows, float32 and bfloat16."""

from __future__ import annotations

import pytest
import torch
from paged_batches import make_paged_batch

from kvtide.attention.torch_backend import TorchAttentionBackend
from kvtide.attention.torch_ref import TorchReferenceBackend

MIXED = [(1, 37), (1, 16), (1, 0), (7, 0), (5, 11), (1, 64), (19, 16), (3, 29)]
DECODES = [(1, 5), (1, 16), (1, 47), (1, 1), (1, 100)]
PREFILLS = [(9, 0), (16, 0), (4, 12), (33, 31)]
EDGES = [(1, 15), (1, 31), (1, 32), (16, 0), (17, 16), (15, 1), (2, 31)]
TOL = {torch.float32: dict(rtol=1e-4, atol=1e-5), torch.bfloat16: dict(rtol=2e-2, atol=2e-2)}


def to_head_major(ref_cache: torch.Tensor) -> torch.Tensor:
    """(2, num_blocks, block_size, H_kv, D) -> (2, H_kv, num_blocks, block_size, D)."""
    return ref_cache.permute(0, 3, 1, 2, 4).contiguous()


def run_both(batch, scale: float, window: int | None, pass_fresh: bool):
    ref_cache = batch.kv_cache.clone()
    ref = TorchReferenceBackend()
    ref.write_kv(batch.key, batch.value, ref_cache, batch.metadata.slot_mapping)
    expected = ref.forward(batch.query, ref_cache, batch.metadata, scale, window)

    fast = TorchAttentionBackend()
    cache = to_head_major(batch.kv_cache)
    fast.write_kv(batch.key, batch.value, cache, batch.metadata.slot_mapping)
    fresh = (batch.key, batch.value) if pass_fresh else (None, None)
    actual = fast.forward(batch.query, cache, batch.metadata, scale, window, *fresh)
    return expected, actual, ref_cache, cache


@pytest.mark.parametrize("requests", [MIXED, DECODES, PREFILLS, EDGES], ids=["mixed", "decodes", "prefills", "edges"])
@pytest.mark.parametrize("heads", [(4, 4), (8, 2), (8, 1)], ids=["mha", "gqa4", "mqa8"])
@pytest.mark.parametrize("window", [None, 7])
@pytest.mark.parametrize("pass_fresh", [True, False])
def test_fast_backend_equals_reference(requests, heads, window, pass_fresh):
    num_heads, num_kv_heads = heads
    batch = make_paged_batch(requests, num_heads, num_kv_heads, 32, 16, torch.float32, seed=len(requests))
    expected, actual, ref_cache, cache = run_both(batch, 32 ** -0.5, window, pass_fresh)
    torch.testing.assert_close(actual, expected, **TOL[torch.float32])
    assert torch.equal(to_head_major(ref_cache), cache)


@pytest.mark.parametrize("block_size", [1, 4, 32])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_block_sizes_and_dtypes(block_size, dtype):
    batch = make_paged_batch(MIXED, 8, 2, 16, block_size, dtype, seed=block_size)
    expected, actual, _, _ = run_both(batch, 0.25, None, True)
    torch.testing.assert_close(actual, expected, **TOL[dtype])


def test_copy_blocks_copies_whole_blocks_in_its_layout():
    backend = TorchAttentionBackend()
    cache = torch.randn(backend.kv_cache_shape(6, 4, 2, 8))
    before = cache.clone()
    backend.copy_blocks(cache, torch.tensor([1, 4]), torch.tensor([3, 0]))
    assert torch.equal(cache[:, :, 3], before[:, :, 1]) and torch.equal(cache[:, :, 0], before[:, :, 4])
    untouched = [1, 2, 4, 5]
    assert torch.equal(cache[:, :, untouched], before[:, :, untouched])


@pytest.mark.parametrize("window", [None, 5])
def test_equal_length_prompts_batched_in_one_call_equal_reference(window):
    """Runs of uncached prompts of one length share an SDPA call; mixed with a cached prefix and
    other lengths around them."""
    requests = [(1, 9), (12, 0), (12, 0), (12, 0), (7, 0), (12, 5), (12, 0), (12, 0)]
    batch = make_paged_batch(requests, 8, 2, 16, 4, torch.float32, seed=3)
    runs = TorchAttentionBackend._prefill_runs(batch.metadata, have_fresh=True)
    assert any(last > first for first, last in runs)
    expected, actual, _, _ = run_both(batch, 0.25, window, pass_fresh=True)
    torch.testing.assert_close(actual, expected, **TOL[torch.float32])


def test_decode_softmax_leaves_no_subnormal_weights():
    """Scores spread wider than the cutoff: softmax alone yields subnormal weights (slow to
    multiply on x86); ours zeroes them and otherwise equals softmax, masked keys staying 0."""
    from kvtide.attention.torch_backend import SOFTMAX_CUTOFF, softmax_without_subnormals

    torch.manual_seed(0)
    scores = torch.randn(4, 8, 3, 96) * 40
    scores[..., 80:] = float("-inf")  # keys past the sequence
    plain = scores.softmax(dim=-1)
    tiny = torch.finfo(torch.float32).tiny
    assert ((plain > 0) & (plain < tiny)).any(), "the case must produce subnormals to be a test"
    ours = softmax_without_subnormals(scores.clone())
    assert not ((ours > 0) & (ours < tiny)).any()
    assert torch.equal(ours[..., 80:], torch.zeros_like(ours[..., 80:]))
    torch.testing.assert_close(ours, plain, rtol=1e-6, atol=float(torch.exp(torch.tensor(-SOFTMAX_CUTOFF))))


def test_decode_contexts_gathered_row_by_row_give_bitwise_the_same_output(monkeypatch):
    """The chunked gather only changes how many rows are gathered at once, not any row's math."""
    from kvtide.attention import torch_backend

    batch = make_paged_batch(DECODES + [(1, 70), (1, 3), (1, 33)], 8, 2, 32, 16, torch.float32, seed=3)
    monkeypatch.setattr(torch_backend, "GATHER_CHUNK_BYTES", 1)  # one row per chunk
    expected, one_row, _, _ = run_both(batch, 32 ** -0.5, None, False)
    monkeypatch.setattr(torch_backend, "GATHER_CHUNK_BYTES", 1 << 40)  # all rows at once
    _, all_rows, _, _ = run_both(batch, 32 ** -0.5, None, False)
    assert torch.equal(one_row, all_rows)
    torch.testing.assert_close(one_row, expected, **TOL[torch.float32])
