"""The attention layer: write this step's K/V into the layer's cache, then let the backend attend.

Metadata is an explicit argument (no global context); the cache tensor is bound once by the
model runner after it sizes the pool.
"""

from __future__ import annotations

import torch
from torch import nn

from kvtide.attention.backend import AttentionBackend, AttentionMetadata


class Attention(nn.Module):
    def __init__(self, num_heads: int, head_dim: int, num_kv_heads: int, scale: float,
                 sliding_window: int | None = None) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.head_dim = head_dim
        self.num_kv_heads = num_kv_heads
        self.scale = scale
        self.sliding_window = sliding_window
        self.kv_cache: torch.Tensor | None = None
        """Bound by the model runner, in the backend's layout (AttentionBackend.kv_cache_shape)."""
        self.backend: AttentionBackend | None = None

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                metadata: AttentionMetadata) -> torch.Tensor:
        """q (T, H, D), k and v (T, H_kv, D) -> (T, H * D)."""
        assert self.kv_cache is not None and self.backend is not None, "KV cache not bound"
        self.backend.write_kv(k, v, self.kv_cache, metadata.slot_mapping)
        out = self.backend.forward(q, self.kv_cache, metadata, self.scale, self.sliding_window, k, v)
        return out.reshape(q.shape[0], self.num_heads * self.head_dim)
