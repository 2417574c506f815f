"""PyTorch attention over the paged KV cache: the oracle every other backend is checked against.

Decodes are computed together: their blocks are gathered into one (num_decodes, max_blocks *
block_size) context, padding masked by seq_lens, and attended in one SDPA call. Prefill chunks are
computed one request at a time with a causal mask offset by the cached prefix:

    query i of a chunk of length L over a context of length S sits at position S - L + i and
    sees keys j with  j <= S - L + i  (and j > S - L + i - window, or j < sink_tokens, with a
    sliding window).

A quantized cache is read through the reference codec (kv_compression/formats.py): gathered blocks
are dequantized whole, then attended exactly as float ones.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kvtide.attention.backend import (
    AttentionBackend,
    AttentionMetadata,
    attend_sdpa,
    decode_context_layout,
    prefill_mask,
    request_blocks,
    soft_cap_scores,
    softmax_with_sinks,
)


class TorchReferenceBackend(AttentionBackend):
    """Straightforward and slow on purpose: every other backend is tested against this one."""

    name = "torch_ref"

    def write_kv(self, key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor,
                 slot_mapping: torch.Tensor, kv_scale: torch.Tensor | None = None) -> None:
        if self.kv_quant is not None:
            assert kv_scale is not None, "a quantized KV cache needs the layer's kv_scale"
            self.kv_quant.write(key, value, kv_cache, slot_mapping, kv_scale)
            return
        num_kv_heads, head_dim = key.shape[1], key.shape[2]
        kv_cache[0].view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, key.to(kv_cache.dtype))
        kv_cache[1].view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, value.to(kv_cache.dtype))

    def forward(self, query: torch.Tensor, kv_cache: torch.Tensor, metadata: AttentionMetadata,
                scale: float, sliding_window: int | None, key: torch.Tensor | None = None,
                value: torch.Tensor | None = None, *, sink_tokens: int = 0,
                kv_scale: torch.Tensor | None = None, logits_soft_cap: float | None = None,
                sink_logits: torch.Tensor | None = None) -> torch.Tensor:
        output = torch.empty_like(query)
        num_decodes = metadata.num_decodes
        if num_decodes:
            output[:num_decodes] = self._decode(query[:num_decodes], kv_cache, metadata, scale,
                                                sliding_window, sink_tokens, kv_scale, logits_soft_cap, sink_logits)
        qsl = metadata.query_start_loc_cpu
        for i in range(num_decodes, metadata.num_reqs):
            start, end = qsl[i], qsl[i + 1]
            output[start:end] = self._prefill_one(query[start:end], kv_cache, metadata, i, scale,
                                                  sliding_window, sink_tokens, kv_scale, logits_soft_cap,
                                                  sink_logits)
        return output

    # ---- decodes: one batched SDPA -----------------------------------------------------------
    def _decode(self, query: torch.Tensor, kv_cache: torch.Tensor, md: AttentionMetadata,
                scale: float, window: int | None, sink_tokens: int,
                kv_scale: torch.Tensor | None, logits_soft_cap: float | None = None,
                sink_logits: torch.Tensor | None = None) -> torch.Tensor:
        num_decodes, num_heads, head_dim = query.shape
        block_ids, mask = self._decode_layout(md, window, sink_tokens)
        key, value = self.gather_blocks(kv_cache, block_ids.flatten(), head_dim, kv_scale, query.dtype)
        num_kv_heads = key.shape[1]
        # (num_decodes, ctx, H_kv, D) for every row
        key = key.view(num_decodes, -1, num_kv_heads, head_dim)
        value = value.view(num_decodes, -1, num_kv_heads, head_dim)
        if logits_soft_cap is not None or sink_logits is not None:  # beyond SDPA: scores spelled out
            group = num_heads // num_kv_heads
            key = key.repeat_interleave(group, dim=2).transpose(1, 2).float()  # (num_decodes, H, ctx, D)
            value = value.repeat_interleave(group, dim=2).transpose(1, 2)
            scores = torch.matmul(query.float().unsqueeze(2), key.transpose(-1, -2)).mul_(scale)
            scores = soft_cap_scores(scores, logits_soft_cap).masked_fill_(~mask, float("-inf"))
            sinks = None if sink_logits is None else sink_logits.float().view(1, num_heads, 1, 1)
            return torch.matmul(softmax_with_sinks(scores, sinks).to(value.dtype), value).squeeze(2)
        out = F.scaled_dot_product_attention(
            query.unsqueeze(2),  # (num_decodes, H, 1, D)
            key.transpose(1, 2), value.transpose(1, 2),
            attn_mask=mask, scale=scale, enable_gqa=num_heads != num_kv_heads)
        return out.squeeze(2)

    @staticmethod
    def _decode_layout(md: AttentionMetadata, window: int | None,
                       sink_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Block ids covering the longest decode context, and a (num_decodes, 1, 1, ctx) mask."""
        block_ids, visible = decode_context_layout(md, window, sink_tokens)
        return block_ids, visible[:, None, None, :]

    # ---- prefill chunks: one request at a time -----------------------------------------------
    def _prefill_one(self, query: torch.Tensor, kv_cache: torch.Tensor, md: AttentionMetadata, i: int,
                     scale: float, window: int | None, sink_tokens: int,
                     kv_scale: torch.Tensor | None, logits_soft_cap: float | None = None,
                     sink_logits: torch.Tensor | None = None) -> torch.Tensor:
        q_len, num_heads, head_dim = query.shape
        seq_len = md.seq_lens_cpu[i]
        block_ids, key_valid = request_blocks(md, i, -(-seq_len // md.block_size))
        key, value = self.gather_blocks(kv_cache, block_ids, head_dim, kv_scale, query.dtype)
        key, value = key[:seq_len], value[:seq_len]
        mask = prefill_mask(q_len, seq_len, window, query.device, sink_tokens, key_valid)
        out = attend_sdpa(query.transpose(0, 1).unsqueeze(0),  # (1, H, q_len, D)
                          key.transpose(0, 1).unsqueeze(0), value.transpose(0, 1).unsqueeze(0),
                          mask, scale, logits_soft_cap, sink_logits)
        return out.squeeze(0).transpose(0, 1)
