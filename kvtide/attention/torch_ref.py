"""PyTorch attention over the paged KV cache: the oracle every other backend is checked against.

Decodes are computed together: their blocks are gathered into one (num_decodes, max_blocks *
block_size) context, padding masked by seq_lens, and attended in one SDPA call. Prefill chunks are
computed one request at a time with a causal mask offset by the cached prefix:

    query i of a chunk of length L over a context of length S sits at position S - L + i and
    sees keys j with  j <= S - L + i  (and j > S - L + i - window with a sliding window).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kvtide.attention.backend import AttentionBackend, AttentionMetadata, decode_context_layout, prefill_mask


class TorchReferenceBackend(AttentionBackend):
    """Straightforward and slow on purpose: every other backend is tested against this one."""

    name = "torch_ref"

    def write_kv(self, key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor,
                 slot_mapping: torch.Tensor) -> None:
        num_kv_heads, head_dim = key.shape[1], key.shape[2]
        kv_cache[0].view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, key)
        kv_cache[1].view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, value)

    def forward(self, query: torch.Tensor, kv_cache: torch.Tensor, metadata: AttentionMetadata,
                scale: float, sliding_window: int | None, key: torch.Tensor | None = None,
                value: torch.Tensor | None = None) -> torch.Tensor:
        output = torch.empty_like(query)
        num_decodes = metadata.num_decodes
        if num_decodes:
            output[:num_decodes] = self._decode(query[:num_decodes], kv_cache, metadata, scale,
                                                sliding_window)
        qsl = metadata.query_start_loc_cpu
        for i in range(num_decodes, metadata.num_reqs):
            start, end = qsl[i], qsl[i + 1]
            output[start:end] = self._prefill_one(query[start:end], kv_cache, metadata, i, scale,
                                                  sliding_window)
        return output

    # ---- decodes: one batched SDPA -----------------------------------------------------------
    def _decode(self, query: torch.Tensor, kv_cache: torch.Tensor, md: AttentionMetadata,
                scale: float, window: int | None) -> torch.Tensor:
        num_decodes = md.num_decodes
        block_ids, mask = self._decode_layout(md, window)
        _, _, block_size, num_kv_heads, head_dim = kv_cache.shape
        ctx = block_ids.shape[1] * block_size
        # One gather for K and V: (2, num_decodes, ctx, H_kv, D)
        kv = kv_cache.index_select(1, block_ids.flatten()).view(2, num_decodes, ctx, num_kv_heads, head_dim)
        key, value = kv[0], kv[1]
        out = F.scaled_dot_product_attention(
            query.unsqueeze(2),  # (num_decodes, H, 1, D)
            key.transpose(1, 2), value.transpose(1, 2),
            attn_mask=mask, scale=scale, enable_gqa=query.shape[1] != num_kv_heads)
        return out.squeeze(2)

    @staticmethod
    def _decode_layout(md: AttentionMetadata, window: int | None) -> tuple[torch.Tensor, torch.Tensor]:
        """Block ids covering the longest decode context, and a (num_decodes, 1, 1, ctx) mask."""
        block_ids, visible = decode_context_layout(md, window)
        return block_ids, visible[:, None, None, :]

    # ---- prefill chunks: one request at a time -----------------------------------------------
    def _prefill_one(self, query: torch.Tensor, kv_cache: torch.Tensor, md: AttentionMetadata, i: int,
                     scale: float, window: int | None) -> torch.Tensor:
        q_len = query.shape[0]
        seq_len = md.seq_lens_cpu[i]
        _, _, block_size, num_kv_heads, head_dim = kv_cache.shape
        num_blocks = -(-seq_len // block_size)
        block_ids = md.block_tables[i, :num_blocks].to(torch.int64)
        key = kv_cache[0].index_select(0, block_ids).view(-1, num_kv_heads, head_dim)[:seq_len]
        value = kv_cache[1].index_select(0, block_ids).view(-1, num_kv_heads, head_dim)[:seq_len]
        mask = prefill_mask(q_len, seq_len, window, query.device)
        out = F.scaled_dot_product_attention(
            query.transpose(0, 1).unsqueeze(0),  # (1, H, q_len, D)
            key.transpose(0, 1).unsqueeze(0), value.transpose(0, 1).unsqueeze(0),
            attn_mask=mask, is_causal=mask is None, scale=scale,
            enable_gqa=query.shape[1] != num_kv_heads)
        return out.squeeze(0).transpose(0, 1)
