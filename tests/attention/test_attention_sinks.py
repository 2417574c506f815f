"""Learned attention sink logits (gpt-oss): every backend that says it applies `sink_logits` equals a
dense float64 computation in which each head's sink logit is one more softmax column, dropped after
the softmax (so the weights on the keys sum to less than 1), on random paged batches of decodes,
prefills and cached prefixes, with and without a window, soft cap and GQA; a backend that cannot is
refused by name (Triton: tests/kernels/test_triton_attention.py). Not to be confused with `sink_tokens` (StreamingLLM's kept first keys)."""

from __future__ import annotations

import pytest
import torch
from paged_batches import make_paged_batch

from kvtide.attention.backend import AttentionMetadata
from kvtide.attention.cpu_backend import CpuAttentionBackend
from kvtide.attention.registry import get_attention_backend
from kvtide.attention.torch_backend import TorchAttentionBackend
from kvtide.attention.torch_ref import TorchReferenceBackend
from kvtide.attention.triton_backend import TritonAttentionBackend
from kvtide.kv_compression.attention_mass import accumulate_attention_mass
from kvtide.layers.attention import Attention

MIXED = [(1, 37), (1, 16), (1, 0), (7, 0), (5, 11), (1, 64), (19, 16), (3, 29), (12, 0), (12, 0)]
SCALE = 0.5
HEAD_DIM = 16


def sink_logits_for(num_heads: int) -> torch.Tensor:
    """Sinks from well below to well above typical scores (~N(0, 4) here), so some heads give the
    sink most of their weight and others almost none."""
    return torch.linspace(-3.0, 4.0, num_heads)


def dense_reference(batch, cache, scale: float, window: int | None, sinks: torch.Tensor | None,
                    cap: float | None = None) -> torch.Tensor:
    """Per request in float64, from the reference-layout cache after this step's writes; the sink
    is concatenated as a last column of the scores, softmaxed with them, then dropped."""
    md = batch.metadata
    out = torch.empty(batch.query.shape, dtype=torch.float64)
    _, _, block_size, num_kv_heads, head_dim = cache.shape
    num_heads = batch.query.shape[1]
    group = num_heads // num_kv_heads
    for i in range(md.num_reqs):
        start, end, seq_len = md.query_start_loc_cpu[i], md.query_start_loc_cpu[i + 1], md.seq_lens_cpu[i]
        blocks = md.block_tables[i, :-(-seq_len // block_size)].long()
        kv = cache[:, blocks].reshape(2, -1, num_kv_heads, head_dim)[:, :seq_len].double()
        key, value = (x.repeat_interleave(group, dim=1).transpose(0, 1) for x in kv)  # (H, S, D)
        q = batch.query[start:end].double().transpose(0, 1)  # (H, L, D)
        scores = q @ key.transpose(1, 2) * scale
        if cap is not None:
            scores = cap * torch.tanh(scores / cap)
        q_pos = torch.arange(seq_len - (end - start), seq_len)[:, None]
        k_pos = torch.arange(seq_len)[None, :]
        visible = k_pos <= q_pos
        if window is not None:
            visible &= k_pos > q_pos - window
        scores = scores.masked_fill(~visible, float("-inf"))
        if sinks is not None:
            column = sinks.double().view(num_heads, 1, 1).expand(num_heads, end - start, 1)
            probs = torch.cat([scores, column], dim=-1).softmax(-1)[..., :-1]
        else:
            probs = scores.softmax(-1)
        out[start:end] = (probs @ value).transpose(0, 1)
    return out


def run(backend, batch, head_major: bool, window: int | None, sinks: torch.Tensor | None,
        cap: float | None = None) -> torch.Tensor:
    cache = batch.kv_cache.clone()
    if head_major:
        cache = cache.permute(0, 3, 1, 2, 4).contiguous()
    backend.write_kv(batch.key, batch.value, cache, batch.metadata.slot_mapping)
    return backend.forward(batch.query, cache, batch.metadata, SCALE, window, batch.key, batch.value,
                           logits_soft_cap=cap, sink_logits=sinks)


def reference_cache(batch) -> torch.Tensor:
    cache = batch.kv_cache.clone()
    TorchReferenceBackend().write_kv(batch.key, batch.value, cache, batch.metadata.slot_mapping)
    return cache


BACKENDS = [(TorchReferenceBackend, False), (TorchAttentionBackend, True), (CpuAttentionBackend, True)]


@pytest.mark.parametrize("backend_cls, head_major", BACKENDS, ids=["torch_ref", "torch", "cpu"])
@pytest.mark.parametrize("window", [None, 9])
@pytest.mark.parametrize("heads", [(4, 4), (8, 2)], ids=["mha", "gqa4"])
def test_attention_with_sinks_equals_dense_reference(backend_cls, head_major, window, heads):
    batch = make_paged_batch(MIXED, *heads, HEAD_DIM, 8, torch.float32, seed=7)
    sinks = sink_logits_for(heads[0])
    ref_cache = reference_cache(batch)
    expected = dense_reference(batch, ref_cache, SCALE, window, sinks)
    actual = run(backend_cls(), batch, head_major, window, sinks)
    torch.testing.assert_close(actual.double(), expected, rtol=1e-4, atol=1e-5)
    # the sinks change the result, per head: the comparison above checks they were applied, to the
    # right heads (a permuted sink vector gives another result)
    assert (dense_reference(batch, ref_cache, SCALE, window, None) - expected).abs().max() > 1e-2
    permuted = dense_reference(batch, ref_cache, SCALE, window, sinks.flip(0))
    assert (permuted - expected).abs().max() > 1e-2


@pytest.mark.parametrize("backend_cls, head_major", BACKENDS, ids=["torch_ref", "torch", "cpu"])
def test_sinks_with_a_soft_cap(backend_cls, head_major):
    batch = make_paged_batch(MIXED, 8, 2, HEAD_DIM, 8, torch.float32, seed=3)
    sinks = sink_logits_for(8)
    expected = dense_reference(batch, reference_cache(batch), SCALE, 9, sinks, cap=2.0)
    torch.testing.assert_close(run(backend_cls(), batch, head_major, 9, sinks, cap=2.0).double(), expected,
                               rtol=1e-4, atol=1e-5)


def test_a_large_sink_takes_the_weight_from_the_keys():
    """A head whose sink logit dwarfs every score attends to almost nothing: its output tends to 0."""
    batch = make_paged_batch([(1, 20), (6, 0)], 4, 4, HEAD_DIM, 8, torch.float32, seed=1)
    sinks = torch.tensor([0.0, 0.0, 0.0, 60.0])
    out = run(TorchAttentionBackend(), batch, True, None, sinks)
    assert out[:, 3].abs().max() < 1e-12 < out[:, :3].abs().max()


def test_attention_mass_leaves_the_sinks_share_out():
    """The drop policy's mass per key is the weight the keys really got: with sinks, less than one a
    query and head."""
    batch = make_paged_batch([(1, 20), (6, 0)], 4, 2, HEAD_DIM, 8, torch.float32, seed=2)
    backend = TorchReferenceBackend()
    cache = reference_cache(batch)
    md: AttentionMetadata = batch.metadata
    totals = []
    for sinks in (None, sink_logits_for(4)):
        acc = torch.zeros(md.block_tables.shape, dtype=torch.float32)
        accumulate_attention_mass(acc, batch.query, cache, md, backend, SCALE, None, 0, None, sink_logits=sinks)
        totals.append(acc.sum(dim=1))
    queries_times_heads = torch.tensor([1 * 4, 6 * 4], dtype=torch.float32)
    torch.testing.assert_close(totals[0], queries_times_heads)
    assert (totals[1] < queries_times_heads - 0.1).all()


def test_a_backend_without_sinks_is_refused_by_name():
    class NoSinkBackend(TorchAttentionBackend):
        name = "nosink"
        supports_attention_sinks = False

    batch = make_paged_batch([(3, 0)], 4, 2, HEAD_DIM, 8, torch.float32)
    attn = Attention(4, HEAD_DIM, 2, SCALE, sink_logits=sink_logits_for(4))
    attn.backend = NoSinkBackend()
    attn.kv_cache = torch.zeros(attn.backend.kv_cache_shape(batch.kv_cache.shape[1], 8, 2, HEAD_DIM))
    with pytest.raises(ValueError, match="nosink attention backend does not apply attention sink logits"):
        attn(batch.query, batch.key, batch.value, batch.metadata)
    assert "sink_logits" in dict(attn.named_parameters())
    assert all(get_attention_backend(name).supports_attention_sinks for name in ("cpu", "torch", "torch_ref"))
    assert TritonAttentionBackend.supports_attention_sinks  # tests/kernels/test_triton_attention.py
