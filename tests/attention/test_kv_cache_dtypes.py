"""Quantized and float KV-cache dtypes in the torch backends, on random mixed paged batches.

Two questions, kept apart:
  1. does each backend read what the reference codec wrote? (the fast torch backend against the
     reference backend on the same quantized cache: equal up to float32 summation order);
  2. is the quantization error what the format allows? (the reference backend on a quantized cache
     against the same batch on a float32 cache, and a layout bug caught by the same bound).
"""

from __future__ import annotations

import pytest
import torch
from paged_batches import make_paged_batch, quantized_cache

from kvtide.attention.torch_backend import TorchAttentionBackend
from kvtide.attention.torch_ref import TorchReferenceBackend
from kvtide.kv_compression.formats import resolve_kv_cache_dtype

FORMATS = ["fp8_e4m3", "fp8_e5m2", "int8", "k8v4"]
MIXED = [(1, 37), (1, 16), (1, 0), (7, 0), (5, 11), (1, 64), (19, 16), (3, 29), (1, 200)]
HEAD_DIM = 64
SCALE = HEAD_DIM ** -0.5

MEAN_ERROR_BOUND = {"fp8_e4m3": 0.02, "fp8_e5m2": 0.04, "int8": 0.005, "k8v4": 0.06}
"""Mean |attention output error| against the float32 cache on unit-normal K/V (output std ~0.43).
The output is a softmax-weighted mean of V rows, so its error follows the codes' rounding error:
fp8 e4m3 keeps 3 mantissa bits (relative error <= 2^-4), e5m2 2 bits (<= 2^-3), int8 rounds to
amax/254 per token-head row, and k8v4's V steps of (max - min)/15 dominate it. Measured over four
seeds: 0.0096, 0.019, 0.0023, 0.028; the bounds are about twice that. A layout or scale bug
(codes read from the wrong token, a scale misapplied) errs by about the output's own size."""


def _run(backend, batch, cache, window=None, sinks=0, kv_scale=None, fresh=True):
    backend.write_kv(batch.key, batch.value, cache, batch.metadata.slot_mapping, kv_scale)
    key, value = (batch.key, batch.value) if fresh else (None, None)
    return backend.forward(batch.query, cache, batch.metadata, SCALE, window, key, value,
                           sink_tokens=sinks, kv_scale=kv_scale)


def _float32_reference(batch, window=None, sinks=0):
    return _run(TorchReferenceBackend(), batch, batch.kv_cache.clone(), window, sinks)


@pytest.mark.parametrize("name", FORMATS)
@pytest.mark.parametrize("window,sinks", [(None, 0), (24, 0), (24, 5)], ids=["full", "window", "sinks"])
@pytest.mark.parametrize("heads", [(8, 2), (4, 4)], ids=["gqa4", "mha"])
def test_torch_backend_reads_quantized_cache_as_reference(name, window, sinks, heads):
    fmt = resolve_kv_cache_dtype(name, torch.float32)
    batch = make_paged_batch(MIXED, *heads, HEAD_DIM, 16, torch.float32, seed=3)
    kv_scale = torch.tensor([0.5, 0.25])  # fp8's per-tensor scales must be applied identically
    ref_cache = quantized_cache(batch.kv_cache, fmt, kv_scale)
    expected = _run(TorchReferenceBackend(fmt), batch, ref_cache, window, sinks, kv_scale)
    fast_cache = quantized_cache(batch.kv_cache, fmt, kv_scale)
    actual = _run(TorchAttentionBackend(fmt), batch, fast_cache, window, sinks, kv_scale)
    assert torch.equal(ref_cache, fast_cache)  # same codec, same bytes
    torch.testing.assert_close(actual, expected, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("name", FORMATS)
def test_quantization_error_within_the_format_bound(name):
    fmt = resolve_kv_cache_dtype(name, torch.float32)
    errors = []
    for seed in range(2):
        batch = make_paged_batch(MIXED, 8, 2, HEAD_DIM, 16, torch.float32, seed=seed)
        kv_scale = torch.ones(2)
        actual = _run(TorchReferenceBackend(fmt), batch, quantized_cache(batch.kv_cache, fmt, kv_scale),
                      kv_scale=kv_scale)
        errors.append((actual - _float32_reference(batch)).abs().mean().item())
    assert max(errors) < MEAN_ERROR_BOUND[name], errors
    assert min(errors) > 0  # the cache really is quantized


@pytest.mark.parametrize("name", FORMATS)
def test_bound_catches_a_layout_bug(name):
    """The same bound fails a cache whose tokens are read one slot off inside their blocks."""
    fmt = resolve_kv_cache_dtype(name, torch.float32)
    batch = make_paged_batch(MIXED, 8, 2, HEAD_DIM, 16, torch.float32, seed=0)
    kv_scale = torch.ones(2)
    backend = TorchReferenceBackend(fmt)
    cache = quantized_cache(batch.kv_cache, fmt, kv_scale)
    backend.write_kv(batch.key, batch.value, cache, batch.metadata.slot_mapping, kv_scale)
    shifted = batch.metadata.slot_mapping  # K/V of every token written one slot later, past its own
    wrong = quantized_cache(batch.kv_cache.roll(1, dims=2), fmt, kv_scale)
    backend.write_kv(batch.key, batch.value, wrong, (shifted // 16) * 16 + (shifted + 1) % 16, kv_scale)
    actual = backend.forward(batch.query, wrong, batch.metadata, SCALE, None, kv_scale=kv_scale)
    assert (actual - _float32_reference(batch)).abs().mean().item() > 2 * MEAN_ERROR_BOUND[name]


@pytest.mark.parametrize("name", ["fp8_e4m3", "fp8_e5m2"])
def test_fp8_per_tensor_scale_is_applied(name):
    """K/V ten times larger than unit-normal: with scale 10 the relative error stays the format's;
    with a scale far too small every code saturates (e4m3 at 448, e5m2 at 57344), which shows only if
    the scale is really divided by on write and multiplied back on read."""
    fmt = resolve_kv_cache_dtype(name, torch.float32)
    batch = make_paged_batch(MIXED, 8, 2, HEAD_DIM, 16, torch.float32, seed=1)
    batch.kv_cache.mul_(10)
    batch.key.mul_(10)
    batch.value.mul_(10)
    batch.query.div_(10)
    expected = _float32_reference(batch)
    scaled = torch.tensor([10.0, 10.0])
    out = _run(TorchReferenceBackend(fmt), batch, quantized_cache(batch.kv_cache, fmt, scaled), kv_scale=scaled)
    rel = (out - expected).abs().mean() / expected.abs().mean()
    assert rel < 3 * MEAN_ERROR_BOUND[name]
    tiny = torch.tensor([1e-5, 1e-5])
    out = _run(TorchReferenceBackend(fmt), batch, quantized_cache(batch.kv_cache, fmt, tiny), kv_scale=tiny)
    assert (out - expected).abs().mean() / expected.abs().mean() > 0.3


def _dense_attention(batch, window, sinks):
    """Plain definition over each request's positions: key j visible to the query at p iff j <= p and
    (no window, or j > p - window, or j < sinks); float64 softmax."""
    md = batch.metadata
    cache = batch.kv_cache.clone()
    flat = cache.view(2, -1, *cache.shape[3:])
    flat[0, md.slot_mapping] = batch.key
    flat[1, md.slot_mapping] = batch.value
    out = torch.empty_like(batch.query)
    group = batch.query.shape[1] // cache.shape[3]
    for r in range(md.num_reqs):
        start, end = md.query_start_loc_cpu[r], md.query_start_loc_cpu[r + 1]
        seq_len = md.seq_lens_cpu[r]
        slots = torch.tensor([int(md.block_tables[r, j // 16]) * 16 + j % 16 for j in range(seq_len)])
        key = flat[0, slots].double().repeat_interleave(group, dim=1)  # (S, H, D)
        value = flat[1, slots].double().repeat_interleave(group, dim=1)
        for t in range(start, end):
            p = seq_len - (end - start) + (t - start)
            j = torch.arange(seq_len)
            visible = j <= p
            if window is not None:
                visible &= (j > p - window) | (j < sinks)
            scores = torch.einsum("hd,shd->hs", batch.query[t].double(), key) * SCALE
            scores[:, ~visible] = float("-inf")
            out[t] = torch.einsum("hs,shd->hd", scores.softmax(-1), value).float()
    return out


@pytest.mark.parametrize("backend_cls", [TorchReferenceBackend, TorchAttentionBackend])
def test_sinks_with_window_match_the_plain_definition(backend_cls):
    batch = make_paged_batch(MIXED, 8, 2, 32, 16, torch.float32, seed=5)
    expected = _dense_attention(batch, 20, 4)
    cache = batch.kv_cache.clone()
    if backend_cls is TorchAttentionBackend:
        cache = cache.permute(0, 3, 1, 2, 4).contiguous()
    for fresh in (True, False):
        actual = backend_cls().forward(batch.query, _write(backend_cls(), batch, cache), batch.metadata, SCALE,
                                       20, *((batch.key, batch.value) if fresh else (None, None)), sink_tokens=4)
        torch.testing.assert_close(actual, expected, rtol=1e-4, atol=1e-5)
    # without the sinks the same batch differs: the sinks are really attended
    plain = backend_cls().forward(batch.query, cache, batch.metadata, SCALE, 20)
    assert (plain - expected).abs().max() > 1e-2


def _write(backend, batch, cache):
    backend.write_kv(batch.key, batch.value, cache, batch.metadata.slot_mapping)
    return cache


@pytest.mark.parametrize("cache_dtype", [torch.bfloat16, torch.float16])
def test_16bit_cache_under_float32_queries(cache_dtype):
    """--kv-cache-dtype bfloat16 on a float32 model: stored rounded, attended in float32."""
    batch = make_paged_batch(MIXED, 8, 2, 32, 16, torch.float32, seed=2)
    rounded = make_paged_batch(MIXED, 8, 2, 32, 16, torch.float32, seed=2)
    for x in (rounded.kv_cache, rounded.key, rounded.value):
        x.copy_(x.to(cache_dtype).float())
    expected = _float32_reference(rounded)
    ref = _run(TorchReferenceBackend(), batch, batch.kv_cache.to(cache_dtype))
    fast = _run(TorchAttentionBackend(), batch, batch.kv_cache.to(cache_dtype).permute(0, 3, 1, 2, 4).contiguous(),
                fresh=False)
    torch.testing.assert_close(ref, expected, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(fast, expected, rtol=1e-4, atol=1e-5)
