"""The Triton backend equals the torch reference (torch_ref.py) on fresh random paged batches:
mixed decode/prefill batches, cached prefixes, odd lengths, block boundaries, GQA 1/4/8, sliding
windows, every float dtype, several KV block sizes and key tiles."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from kvtide.attention.torch_ref import TorchReferenceBackend  # noqa: E402
from kvtide.attention.triton_backend import TritonAttentionBackend  # noqa: E402
from kvtide.attention.triton_kernels import paged_attention, write_kv_cache  # noqa: E402

pytestmark = pytest.mark.triton

HEAD_DIM = 32

# (query_len, cached_len) per request
MIXED = [(1, 37), (1, 16), (1, 0), (7, 0), (5, 11), (1, 64), (19, 16), (3, 29)]
BLOCK_EDGES = [(1, 15), (1, 31), (1, 32), (16, 0), (17, 16), (15, 1), (2, 31)]
LONG_PREFILL = [(1, 40), (70, 9)]  # several q blocks in one request
VERIFY = [(1, 30), (4, 37), (6, 16), (2, 63), (8, 100), (5, 0), (3, 15)]
"""Speculative verification: rows of K+1 query tokens over a cached context, beside decodes."""


def _reference(batch, scale: float, window: int | None) -> torch.Tensor:
    ref = TorchReferenceBackend()
    cache = batch.kv_cache.clone()
    ref.write_kv(batch.key, batch.value, cache, batch.metadata.slot_mapping)
    return ref.forward(batch.query, cache, batch.metadata, scale, window)


def _triton(batch, scale: float, window: int | None) -> torch.Tensor:
    backend = TritonAttentionBackend()
    cache = batch.kv_cache.clone()
    backend.write_kv(batch.key, batch.value, cache, batch.metadata.slot_mapping)
    return backend.forward(batch.query, cache, batch.metadata, scale, window)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("block_size", [1, 16])
def test_write_kv_equals_reference(paged_batch, device, dtype, block_size):
    batch = paged_batch(MIXED, 4, 2, HEAD_DIM, block_size, dtype, device, seed=1)
    expected = batch.kv_cache.clone()
    TorchReferenceBackend().write_kv(batch.key, batch.value, expected, batch.metadata.slot_mapping)
    actual = batch.kv_cache.clone()
    write_kv_cache(batch.key, batch.value, actual, batch.metadata.slot_mapping)
    assert torch.equal(actual, expected)


def test_write_kv_takes_strided_views_and_skips_padding(paged_batch, device):
    """k and v come as column slices of the fused qkv output; slot -1 marks a padding token."""
    batch = paged_batch([(1, 3), (1, 8), (4, 2)], 4, 2, HEAD_DIM, 4, torch.float32, device, seed=2)
    num_tokens, kv = batch.key.shape[0], 2 * HEAD_DIM
    qkv = torch.randn(num_tokens, 4 * HEAD_DIM + 2 * kv, device=device)
    key = qkv[:, 4 * HEAD_DIM:4 * HEAD_DIM + kv].view(num_tokens, 2, HEAD_DIM)
    value = qkv[:, 4 * HEAD_DIM + kv:].view(num_tokens, 2, HEAD_DIM)
    slots = batch.metadata.slot_mapping.clone()
    slots[1] = -1
    expected = batch.kv_cache.clone()
    keep = slots >= 0
    TorchReferenceBackend().write_kv(key[keep], value[keep], expected, slots[keep])
    actual = batch.kv_cache.clone()
    write_kv_cache(key, value, actual, slots)
    assert torch.equal(actual, expected)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("num_heads,num_kv_heads", [(2, 2), (8, 2), (8, 1)])
def test_mixed_batch_equals_reference(paged_batch, device, close, dtype, num_heads, num_kv_heads):
    batch = paged_batch(MIXED, num_heads, num_kv_heads, HEAD_DIM, 16, dtype, device, seed=3)
    scale = HEAD_DIM ** -0.5
    close(_triton(batch, scale, None), _reference(batch, scale, None), dtype)


@pytest.mark.parametrize("window", [1, 5, 16, 33])
@pytest.mark.parametrize("num_heads,num_kv_heads", [(2, 2), (8, 1)])
def test_sliding_window_equals_reference(paged_batch, device, close, window, num_heads, num_kv_heads):
    batch = paged_batch(MIXED, num_heads, num_kv_heads, HEAD_DIM, 8, torch.float32, device, seed=4)
    close(_triton(batch, 0.3, window), _reference(batch, 0.3, window), torch.float32)


@pytest.mark.parametrize("block_size", [1, 2, 4, 16, 32, 128])
def test_block_sizes_and_block_boundaries(paged_batch, device, close, block_size):
    batch = paged_batch(BLOCK_EDGES, 8, 2, HEAD_DIM, block_size, torch.float32, device, seed=5)
    close(_triton(batch, 0.2, None), _reference(batch, 0.2, None), torch.float32)


@pytest.mark.parametrize("tile_n", [16, 32])
@pytest.mark.parametrize("window", [None, 20])
def test_key_tiles_smaller_and_larger_than_blocks(paged_batch, device, close, tile_n, window):
    batch = paged_batch(BLOCK_EDGES + [(1, 50)], 2, 1, HEAD_DIM, 32, torch.float32, device, seed=6)
    md = batch.metadata
    cache = batch.kv_cache.clone()
    write_kv_cache(batch.key, batch.value, cache, md.slot_mapping)
    out = paged_attention(batch.query, cache, md.query_start_loc, md.seq_lens, md.block_tables, md.num_reqs,
                          md.max_query_len, 0.25, window, tile_n=tile_n)
    close(out, _reference(batch, 0.25, window), torch.float32)


@pytest.mark.parametrize("num_heads,num_kv_heads", [(2, 2), (8, 2), (16, 2)])
def test_long_prefill_spans_several_query_blocks(paged_batch, device, close, num_heads, num_kv_heads):
    batch = paged_batch(LONG_PREFILL, num_heads, num_kv_heads, HEAD_DIM, 16, torch.bfloat16, device, seed=7)
    close(_triton(batch, 0.2, None), _reference(batch, 0.2, None), torch.bfloat16)


@pytest.mark.parametrize("num_heads,num_kv_heads", [(8, 2), (8, 1)])
@pytest.mark.parametrize("window", [None, 9])
def test_verification_rows_equal_reference(paged_batch, device, close, num_heads, num_kv_heads, window):
    batch = paged_batch(VERIFY, num_heads, num_kv_heads, HEAD_DIM, 16, torch.float32, device, seed=9)
    close(_triton(batch, 0.2, window), _reference(batch, 0.2, window), torch.float32)


@pytest.mark.parametrize("num_heads,num_kv_heads", [(2, 2), (8, 2), (8, 1)])
@pytest.mark.parametrize("window", [None, 7])
def test_decode_only_batch(paged_batch, device, close, num_heads, num_kv_heads, window):
    batch = paged_batch([(1, n) for n in (0, 1, 15, 16, 40, 77)], num_heads, num_kv_heads, HEAD_DIM, 16,
                        torch.float32, device, seed=8)
    close(_triton(batch, 0.2, window), _reference(batch, 0.2, window), torch.float32)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("window", [None, 9])
def test_logits_soft_cap_equals_reference(paged_batch, device, close, dtype, window):
    """Gemma 2's cap * tanh(score / cap), with scores well past the cap (scale 1 on head_dim 32)."""
    batch = paged_batch(MIXED + VERIFY[:2], 8, 2, HEAD_DIM, 16, dtype, device, seed=11)
    md, cap = batch.metadata, 3.0
    cache = batch.kv_cache.clone()
    TritonAttentionBackend().write_kv(batch.key, batch.value, cache, md.slot_mapping)
    actual = TritonAttentionBackend().forward(batch.query, cache, md, 1.0, window, logits_soft_cap=cap)
    ref_cache = batch.kv_cache.clone()
    TorchReferenceBackend().write_kv(batch.key, batch.value, ref_cache, md.slot_mapping)
    expected = TorchReferenceBackend().forward(batch.query, ref_cache, md, 1.0, window, logits_soft_cap=cap)
    close(actual, expected, dtype)
    uncapped = TorchReferenceBackend().forward(batch.query, ref_cache, md, 1.0, window)
    assert (uncapped.float() - expected.float()).abs().max() > 0.1


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("window", [None, 9])
@pytest.mark.parametrize("cap", [None, 3.0])
def test_attention_sink_logits_equal_reference(paged_batch, device, close, dtype, window, cap):
    """gpt-oss's per-head sink logits in every softmax denominator, from below to well above the
    scores, with GQA 4, windows, verification rows, and a soft cap alongside."""
    batch = paged_batch(MIXED + VERIFY[:2], 8, 2, HEAD_DIM, 16, dtype, device, seed=12)
    md = batch.metadata
    sinks = torch.linspace(-3.0, 5.0, 8, device=device)
    cache = batch.kv_cache.clone()
    TritonAttentionBackend().write_kv(batch.key, batch.value, cache, md.slot_mapping)
    actual = TritonAttentionBackend().forward(batch.query, cache, md, 0.3, window, logits_soft_cap=cap,
                                              sink_logits=sinks)
    ref_cache = batch.kv_cache.clone()
    TorchReferenceBackend().write_kv(batch.key, batch.value, ref_cache, md.slot_mapping)
    expected = TorchReferenceBackend().forward(batch.query, ref_cache, md, 0.3, window, logits_soft_cap=cap,
                                               sink_logits=sinks)
    close(actual, expected, dtype)
    sinkless = TorchReferenceBackend().forward(batch.query, ref_cache, md, 0.3, window, logits_soft_cap=cap)
    assert (sinkless.float() - expected.float()).abs().max() > 0.1


def test_odd_head_dim_and_wide_block_table(paged_batch, device, close):
    """head_dim not a power of two (masked lanes); block tables wider than needed (static buffers)."""
    batch = paged_batch(MIXED[:5], 6, 2, 40, 8, torch.float32, device, seed=9, table_width=20)
    close(_triton(batch, 0.15, None), _reference(batch, 0.15, None), torch.float32)


def test_padding_rows_of_a_decode_bucket(paged_batch, device, close):
    """CUDA-graph padding: extra requests with one token, seq_len 0 and slot -1 attend to nothing
    (output 0), write nothing, and leave the real rows unchanged."""
    batch = paged_batch([(1, 5), (1, 20), (1, 33)], 8, 2, HEAD_DIM, 16, torch.float32, device, seed=10)
    md = batch.metadata
    expected = _reference(batch, 0.2, None)
    pad = 5
    query = torch.cat([batch.query, torch.randn(pad, 8, HEAD_DIM, device=device)])
    key = torch.cat([batch.key, torch.randn(pad, 2, HEAD_DIM, device=device)])
    value = torch.cat([batch.value, torch.randn(pad, 2, HEAD_DIM, device=device)])
    num_reqs = md.num_reqs + pad
    query_start_loc = torch.arange(num_reqs + 1, dtype=torch.int32, device=device)
    seq_lens = torch.cat([md.seq_lens, torch.zeros(pad, dtype=torch.int32, device=device)])
    block_tables = torch.cat([md.block_tables, torch.zeros(pad, md.block_tables.shape[1], dtype=torch.int32,
                                                           device=device)])
    slots = torch.cat([md.slot_mapping, torch.full((pad,), -1, dtype=torch.int64, device=device)])
    cache = batch.kv_cache.clone()
    write_kv_cache(key, value, cache, slots)
    reference_cache = batch.kv_cache.clone()
    TorchReferenceBackend().write_kv(batch.key, batch.value, reference_cache, md.slot_mapping)
    assert torch.equal(cache, reference_cache)
    out = paged_attention(query, cache, query_start_loc, seq_lens, block_tables, num_reqs, 1, 0.2)
    close(out[:md.num_reqs], expected, torch.float32)
    assert torch.equal(out[md.num_reqs:], torch.zeros_like(out[md.num_reqs:]))


def test_empty_batch(device):
    cache = torch.zeros(2, 4, 16, 2, HEAD_DIM, device=device)
    empty = torch.empty(0, 4, HEAD_DIM, device=device)
    write_kv_cache(empty[:, :2], empty[:, :2], cache, torch.empty(0, dtype=torch.int64, device=device))
    out = paged_attention(empty, cache, torch.zeros(1, dtype=torch.int32, device=device),
                          torch.empty(0, dtype=torch.int32, device=device),
                          torch.empty(0, 1, dtype=torch.int32, device=device), 0, 0, 0.2)
    assert out.shape == (0, 4, HEAD_DIM)
