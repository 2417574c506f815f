"""Attention logit soft-capping (Gemma 2): every backend that says it applies `logits_soft_cap`
equals a dense float64 computation of cap * tanh(scale * q.k / cap), masked causally (and by the
window) and softmaxed, on random paged batches of decodes, prefills and cached prefixes; a backend
that cannot is refused by name. (Triton: tests/kernels/test_triton_attention.py.)"""

from __future__ import annotations

import pytest
import torch
from paged_batches import make_paged_batch

from kvtide.attention.cpu_backend import CpuAttentionBackend
from kvtide.attention.registry import get_attention_backend
from kvtide.attention.torch_backend import TorchAttentionBackend
from kvtide.attention.torch_ref import TorchReferenceBackend
from kvtide.layers.attention import Attention

MIXED = [(1, 37), (1, 16), (1, 0), (7, 0), (5, 11), (1, 64), (19, 16), (3, 29), (12, 0), (12, 0)]
SCALE = 0.5
CAP = 2.0
"""Random q and k of head_dim 16 score ~N(0, 4) after SCALE: most scores are bent by the cap."""


def dense_reference(batch, cache, scale: float, cap: float | None, window: int | None) -> torch.Tensor:
    """Per request in float64, from the reference-layout cache after this step's writes."""
    md = batch.metadata
    out = torch.empty(batch.query.shape, dtype=torch.float64)
    _, _, block_size, num_kv_heads, head_dim = cache.shape
    group = batch.query.shape[1] // num_kv_heads
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
        out[start:end] = (scores.masked_fill(~visible, float("-inf")).softmax(-1) @ value).transpose(0, 1)
    return out


def run(backend, batch, head_major: bool, cap: float | None, window: int | None) -> torch.Tensor:
    cache = batch.kv_cache.clone()
    if head_major:
        cache = cache.permute(0, 3, 1, 2, 4).contiguous()
    backend.write_kv(batch.key, batch.value, cache, batch.metadata.slot_mapping)
    return backend.forward(batch.query, cache, batch.metadata, SCALE, window, batch.key, batch.value,
                           logits_soft_cap=cap)


@pytest.mark.parametrize("backend_cls, head_major", [(TorchReferenceBackend, False), (TorchAttentionBackend, True),
                                                     (CpuAttentionBackend, True)], ids=["torch_ref", "torch", "cpu"])
@pytest.mark.parametrize("window", [None, 9])
@pytest.mark.parametrize("heads", [(4, 4), (8, 2)], ids=["mha", "gqa4"])
def test_soft_capped_attention_equals_dense_reference(backend_cls, head_major, window, heads):
    batch = make_paged_batch(MIXED, *heads, 16, 8, torch.float32, seed=5)
    ref_cache = batch.kv_cache.clone()
    TorchReferenceBackend().write_kv(batch.key, batch.value, ref_cache, batch.metadata.slot_mapping)
    expected = dense_reference(batch, ref_cache, SCALE, CAP, window)
    actual = run(backend_cls(), batch, head_major, CAP, window)
    torch.testing.assert_close(actual.double(), expected, rtol=1e-4, atol=1e-5)
    # the cap changes the result: the comparison above checks it was applied
    uncapped = dense_reference(batch, ref_cache, SCALE, None, window)
    assert (uncapped - expected).abs().max() > 1e-2


def test_a_backend_without_soft_capping_is_refused_by_name():
    class NoCapBackend(TorchAttentionBackend):
        name = "nocap"
        supports_logits_soft_cap = False

    batch = make_paged_batch([(3, 0)], 4, 2, 16, 8, torch.float32)
    attn = Attention(4, 16, 2, SCALE, logits_soft_cap=CAP)
    attn.backend = NoCapBackend()
    attn.kv_cache = torch.zeros(attn.backend.kv_cache_shape(batch.kv_cache.shape[1], 8, 2, 16))
    with pytest.raises(ValueError, match="nocap attention backend does not apply attention logit soft-capping"):
        attn(batch.query, batch.key, batch.value, batch.metadata)
    assert all(get_attention_backend(name).supports_logits_soft_cap for name in ("cpu", "torch", "torch_ref"))
