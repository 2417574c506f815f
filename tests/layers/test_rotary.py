"""Rotary embedding against transformers' apply_rotary_pos_emb, and the fused q|k path against the
separate one."""

from __future__ import annotations

from types import SimpleNamespace

import torch
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

from kvtide.layers.rotary import RotaryEmbedding

HEAD_DIM, HEADS, KV_HEADS = 16, 6, 2


def qkv_and_rope(num_tokens: int = 7):
    config = SimpleNamespace(rope_theta=500.0, max_position_embeddings=128)
    rope = RotaryEmbedding(config, HEAD_DIM, 128, torch.float32)
    qkv = torch.randn(num_tokens, (HEADS + 2 * KV_HEADS) * HEAD_DIM, generator=torch.Generator().manual_seed(0))
    positions = torch.tensor([0, 1, 5, 6, 64, 100, 127])[:num_tokens]
    return rope, qkv, positions


def test_rotation_matches_transformers():
    rope, qkv, positions = qkv_and_rope()
    q = qkv[:, :HEADS * HEAD_DIM].view(-1, HEADS, HEAD_DIM)
    k = qkv[:, HEADS * HEAD_DIM:(HEADS + KV_HEADS) * HEAD_DIM].view(-1, KV_HEADS, HEAD_DIM)
    out_q, out_k = rope(rope.cos_sin(positions), q, k)
    cos, sin = rope.cos_cache[positions][None], rope.sin_cache[positions][None]  # (1, T, D)
    ref_q, ref_k = apply_rotary_pos_emb(q.transpose(0, 1)[None], k.transpose(0, 1)[None], cos, sin)
    torch.testing.assert_close(out_q, ref_q[0].transpose(0, 1), rtol=0, atol=1e-6)
    torch.testing.assert_close(out_k, ref_k[0].transpose(0, 1), rtol=0, atol=1e-6)
    assert not torch.equal(out_q, q)  # the rotation did something


def test_fused_qk_rotation_is_bit_identical_to_separate():
    rope, qkv, positions = qkv_and_rope()
    cos_sin = rope.cos_sin(positions)
    original = qkv.clone()
    qk = qkv[:, :(HEADS + KV_HEADS) * HEAD_DIM].view(-1, HEADS + KV_HEADS, HEAD_DIM)
    q, k = rope.forward_qk(cos_sin, qk, HEADS)
    ref_q, ref_k = rope(cos_sin, qk[:, :HEADS], qk[:, HEADS:])
    assert q.shape == (7, HEADS, HEAD_DIM) and k.shape == (7, KV_HEADS, HEAD_DIM)
    assert torch.equal(q, ref_q) and torch.equal(k, ref_k)
    assert torch.equal(qkv, original)  # qkv (and so v) untouched
