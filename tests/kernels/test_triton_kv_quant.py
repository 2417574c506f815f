"""The Triton kernels over quantized KV caches (kv_compression/formats.py) and the newer float-cache
cases: the write kernel codes bytes equal to the reference codec (KVQuantFormat.write), attention
over the codes equals torch_ref.py (and a plain float64 attention over KVQuantFormat.read_blocks),
attention sinks with a window, and a cache dtype other than the query's. Tiny shapes: under the
interpreter every program is a Python call."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from kvtide.attention.torch_ref import TorchReferenceBackend  # noqa: E402
from kvtide.attention.triton_backend import TritonAttentionBackend  # noqa: E402
from kvtide.attention.triton_kernels import write_kv_cache  # noqa: E402
from kvtide.kv_compression.formats import KVQuantFormat, resolve_kv_cache_dtype  # noqa: E402

pytestmark = pytest.mark.triton

FORMATS = ["fp8_e4m3", "fp8_e5m2", "int8", "k8v4"]
HEAD_DIM = 32
BLOCK_SIZE = 4
# (query_len, cached_len): decodes, one over a single partial block, and prefill chunks over a
# cached prefix and without one; with BLOCK_SIZE 4 most contexts end inside a block
REQUESTS = [(1, 21), (1, 2), (6, 11), (3, 0)]
WINDOW, SINKS = 5, 2
KV_SCALE = (0.05, 0.02)
"""fp8's per-tensor K and V scales: not 1, and unequal, so a missing or swapped scale shows."""
WRITE_KV_SCALE = (0.25, 2.0 ** -5)
"""Powers of two for the write test, so the tie rows' x / scale are the intended halves exactly."""


def _format(name: str) -> KVQuantFormat:
    fmt = resolve_kv_cache_dtype(name, torch.float32)
    assert isinstance(fmt, KVQuantFormat)
    return fmt


def _kv_scale(device, values=KV_SCALE) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float32, device=device)


def _random_rows(num_tokens: int, num_kv_heads: int, gen: torch.Generator) -> torch.Tensor:
    """Rows of varied magnitude (fp8 exponents, int8/int4 scales), an all-zero row (int8's zero
    scale becomes 1.0) and a constant row (int4's zero step becomes 1.0)."""
    x = torch.randn(num_tokens, num_kv_heads, HEAD_DIM, generator=gen)
    x *= torch.exp2(torch.randint(-6, 5, (num_tokens, num_kv_heads, 1), generator=gen).float())
    x[0, 0] = 0.0
    x[1, -1] = 0.75
    return x


def _ties(fmt: KVQuantFormat) -> torch.Tensor:
    """(2, 1, HEAD_DIM) rows whose quantized values fall exactly halfway between two codes: torch
    rounds ties to even, and so must the kernel (its rounding is round-half-even by construction)."""
    if fmt.k_kind.startswith("fp8"):
        # e4m3: 1.0625 between 1 and 1.125, 1.9375 rounds up into the next binade, 1.5 and
        # 2.5 * 2**-9 between subnormals, 480 past the largest finite (clamped first); e5m2: 1.125,
        # 1.375, 1.875 into the next binade, subnormal halves at 2**-16, 61440 clamped
        halves = [1.0625, 1.1875, 1.9375, 1.5 * 2 ** -9, 2.5 * 2 ** -9, 1.125, 1.375, 1.875,
                  1.5 * 2 ** -16, 2.5 * 2 ** -16, 1000.0, 448.0, 480.0, 0.0, 61440.0, 3.0]
        row = torch.tensor(halves * (HEAD_DIM // len(halves)))
        k = row * torch.tensor([1.0, -1.0]).repeat(HEAD_DIM // 2) * WRITE_KV_SCALE[0]
        return torch.stack([k, row * WRITE_KV_SCALE[1]])[:, None]
    # int8: amax 63.5 gives the float16 scale 0.5 exactly, so x = 1.25 codes 2.5 -> 2, 1.75 -> 4;
    # int4 (V of k8v4): min 0, max 7.5 gives the step 0.5, so 1.25 codes 2.5 -> 2, 0.75 -> 2
    row = torch.tensor([63.5, 1.25, 1.75, -2.25, 0.25, 0.75, 7.25, 0.0] * (HEAD_DIM // 8))
    return torch.stack([row, row.clamp(0.0, 7.5)])[:, None]


@pytest.mark.parametrize("name", FORMATS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_write_equals_reference_codec(device, name, dtype):
    """Byte for byte, params included, through padding slots, odd-sized blocks and scattered slots.
    No tie needs excusing: both sides divide with IEEE rounding and round ties to even."""
    fmt = _format(name)
    gen = torch.Generator().manual_seed(1)
    num_tokens, num_kv_heads, num_blocks = 11, 3, 5
    block_size = 3  # not a power of two: section offsets and params at odd byte addresses
    key = _random_rows(num_tokens, num_kv_heads, gen).to(dtype)
    value = _random_rows(num_tokens, num_kv_heads, gen).to(dtype)
    ties = _ties(fmt).to(dtype)
    key[2], value[2] = ties[0].expand(num_kv_heads, HEAD_DIM), ties[1].expand(num_kv_heads, HEAD_DIM)
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:num_tokens]
    slots[4] = -1  # a padding token: writes nothing
    cache = torch.randint(0, 256, fmt.cache_shape(num_blocks, block_size, num_kv_heads, HEAD_DIM),
                          dtype=torch.uint8, generator=gen)
    kv_scale = _kv_scale("cpu", WRITE_KV_SCALE)
    expected = cache.clone()
    keep = slots >= 0
    fmt.write(key[keep], value[keep], expected, slots[keep], kv_scale)
    actual = cache.to(device)
    write_kv_cache(key.to(device), value.to(device), actual, slots.to(device), fmt, kv_scale.to(device))
    mismatch = (actual.cpu() != expected).nonzero()
    assert mismatch.numel() == 0, f"{mismatch.shape[0]} bytes differ, first at {mismatch[:5].tolist()}"


def _quantized_batch(paged_batch, device, fmt: KVQuantFormat, num_heads: int, num_kv_heads: int,
                     dtype: torch.dtype, seed: int):
    """A random mixed batch whose cache holds the quantized random float cache of paged_batch (so
    the cached prefixes are valid codes), plus this step's new K/V written by the Triton kernel."""
    batch = paged_batch(REQUESTS, num_heads, num_kv_heads, HEAD_DIM, BLOCK_SIZE, dtype, device, seed=seed)
    num_blocks = batch.kv_cache.shape[1]
    kv_scale = _kv_scale(device)
    cache = torch.zeros(fmt.cache_shape(num_blocks, BLOCK_SIZE, num_kv_heads, HEAD_DIM), dtype=torch.uint8,
                        device=device)
    every_slot = torch.arange(num_blocks * BLOCK_SIZE, device=device)
    float_cache = batch.kv_cache.reshape(2, -1, num_kv_heads, HEAD_DIM)
    fmt.write(float_cache[0], float_cache[1], cache, every_slot, kv_scale)
    expected = cache.clone()
    fmt.write(batch.key, batch.value, expected, batch.metadata.slot_mapping, kv_scale)
    TritonAttentionBackend(fmt).write_kv(batch.key, batch.value, cache, batch.metadata.slot_mapping, kv_scale)
    assert torch.equal(cache, expected)
    return batch, cache, kv_scale


def _plain_attention(fmt: KVQuantFormat, query: torch.Tensor, cache: torch.Tensor, md, kv_scale: torch.Tensor,
                     scale: float, window: int | None, sinks: int) -> torch.Tensor:
    """Float64 softmax attention over KVQuantFormat.read_blocks, one query row at a time."""
    out = torch.zeros(query.shape, dtype=torch.float64)
    qpk = query.shape[1] // cache.shape[0]
    for i in range(md.num_reqs):
        start, end, seq_len = md.query_start_loc_cpu[i], md.query_start_loc_cpu[i + 1], md.seq_lens_cpu[i]
        blocks = md.block_tables[i, :-(-seq_len // md.block_size)].long()
        key, value = fmt.read_blocks(cache[:, blocks].cpu(), HEAD_DIM, kv_scale.cpu(), torch.float64)
        key, value = key[:, :seq_len].repeat_interleave(qpk, 0), value[:, :seq_len].repeat_interleave(qpk, 0)
        for t in range(start, end):
            pos = seq_len - (end - start) + (t - start)
            j = torch.arange(seq_len)
            visible = j <= pos
            if window is not None:
                visible &= (j > pos - window) | (j < sinks)
            scores = torch.einsum("hd,hnd->hn", query[t].double().cpu(), key) * scale
            probs = scores.masked_fill(~visible, float("-inf")).softmax(-1)
            out[t] = torch.einsum("hn,hnd->hd", probs, value)
    return out


@pytest.mark.parametrize("name", FORMATS)
@pytest.mark.parametrize("window", [None, WINDOW])
def test_attention_equals_reference(paged_batch, device, name, window):
    """float32 queries over the codes: the kernel applies the same dequantization (scales around
    the dot instead of on the tile, which only reorders float32 roundings, ~1e-7 relative) and
    float32 accumulation, so it stays within 1e-4 of both float references."""
    fmt = _format(name)
    batch, cache, kv_scale = _quantized_batch(paged_batch, device, fmt, 8, 2, torch.float32, seed=3)
    md, scale = batch.metadata, HEAD_DIM ** -0.5
    sinks = SINKS if window else 0
    out = TritonAttentionBackend(fmt).forward(batch.query, cache, md, scale, window, sink_tokens=sinks,
                                              kv_scale=kv_scale)
    reference = TorchReferenceBackend(fmt).forward(batch.query, cache, md, scale, window, sink_tokens=sinks,
                                                   kv_scale=kv_scale)
    torch.testing.assert_close(out.cpu(), reference.cpu(), rtol=1e-4, atol=1e-4)
    plain = _plain_attention(fmt, batch.query, cache, md, kv_scale, scale, window, sinks)
    torch.testing.assert_close(out.cpu().double(), plain, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("name", ["fp8_e4m3", "k8v4"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_attention_equals_reference(paged_batch, device, name, dtype):
    """bf16 / fp16 queries. The codes enter the dots exactly, but P (times int8's or int4's per-key
    V scale) is rounded to the query dtype for the P @ V dot, and the output too: bf16 keeps 8
    significant bits, about 4e-3 relative per rounding (the interpreter truncates: 8e-3), against a
    float64 reference over the same dequantized K/V. Hence bf16's usual 2e-2, not float32's 1e-4."""
    fmt = _format(name)
    batch, cache, kv_scale = _quantized_batch(paged_batch, device, fmt, 4, 1, dtype, seed=4)
    md = batch.metadata
    out = TritonAttentionBackend(fmt).forward(batch.query, cache, md, 0.2, WINDOW, sink_tokens=SINKS,
                                              kv_scale=kv_scale)
    assert out.dtype == dtype
    plain = _plain_attention(fmt, batch.query, cache, md, kv_scale, 0.2, WINDOW, SINKS)
    torch.testing.assert_close(out.cpu().double(), plain, rtol=2e-2, atol=2e-2)


def test_kv_scale_is_read_on_the_device(paged_batch, device):
    """fp8 scales come through the tensor (what a CUDA graph replays), not a host copy: doubling
    kv_scale[1] in place doubles the output."""
    fmt = _format("fp8_e5m2")
    batch, cache, kv_scale = _quantized_batch(paged_batch, device, fmt, 2, 2, torch.float32, seed=5)
    backend = TritonAttentionBackend(fmt)
    first = backend.forward(batch.query, cache, batch.metadata, 0.2, None, kv_scale=kv_scale)
    kv_scale[1] *= 2
    second = backend.forward(batch.query, cache, batch.metadata, 0.2, None, kv_scale=kv_scale)
    torch.testing.assert_close(second, 2 * first, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("window,sinks,tile_n", [(3, 1, 16), (6, 4, 16), (2, 30, 16), (9, 20, 64)])
def test_sinks_on_a_float_cache(paged_batch, device, window, sinks, tile_n):
    """Sinks below the window, overlapping it, covering whole key tiles, and beyond the context."""
    from kvtide.attention.triton_kernels import paged_attention

    requests = [(1, 40), (1, 3), (5, 33), (4, 0)]
    batch = paged_batch(requests, 4, 2, HEAD_DIM, BLOCK_SIZE, torch.float32, device, seed=6)
    md = batch.metadata
    cache = batch.kv_cache.clone()
    write_kv_cache(batch.key, batch.value, cache, md.slot_mapping)
    out = paged_attention(batch.query, cache, md.query_start_loc, md.seq_lens, md.block_tables, md.num_reqs,
                          md.max_query_len, 0.3, window, tile_n=tile_n, sink_tokens=sinks)
    reference = TorchReferenceBackend().forward(batch.query, cache, md, 0.3, window, sink_tokens=sinks)
    torch.testing.assert_close(out, reference, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("cache_dtype", [torch.bfloat16, torch.float16])
def test_float_cache_in_another_dtype(paged_batch, device, cache_dtype):
    """float32 queries and K/V over a bf16 / fp16 cache: the write rounds to the cache dtype as
    torch's .to() does, attention returns float32 computed from the stored (rounded) values, so
    float32's 1e-4 holds against the reference reading the same cache."""
    batch = paged_batch(REQUESTS, 4, 2, HEAD_DIM, BLOCK_SIZE, torch.float32, device, seed=7)
    md = batch.metadata
    start = batch.kv_cache.to(cache_dtype)
    expected = start.clone()
    TorchReferenceBackend().write_kv(batch.key, batch.value, expected, md.slot_mapping)
    backend = TritonAttentionBackend()
    cache = start.clone()
    backend.write_kv(batch.key, batch.value, cache, md.slot_mapping)
    assert torch.equal(cache, expected)
    out = backend.forward(batch.query, cache, md, 0.2, WINDOW, sink_tokens=SINKS)
    assert out.dtype == torch.float32
    reference = TorchReferenceBackend().forward(batch.query, cache, md, 0.2, WINDOW, sink_tokens=SINKS)
    torch.testing.assert_close(out, reference, rtol=1e-4, atol=1e-4)
