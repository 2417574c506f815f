"""The attention layer: write this step's K/V into the layer's cache, then let the backend attend.

Metadata is an explicit argument (no global context); the cache tensor is bound once by the
model runner after it sizes the pool.
"""

from __future__ import annotations

import torch
from torch import nn

from kvtide.attention.backend import AttentionBackend, AttentionMetadata
from kvtide.kv_compression.attention_mass import accumulate_attention_mass


class Attention(nn.Module):
    def __init__(self, num_heads: int, head_dim: int, num_kv_heads: int, scale: float,
                 sliding_window: int | None = None, logits_soft_cap: float | None = None,
                 sink_logits: torch.Tensor | None = None) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.head_dim = head_dim
        self.num_kv_heads = num_kv_heads
        self.scale = scale
        self.sliding_window = sliding_window
        self.logits_soft_cap = logits_soft_cap
        """c: scaled scores s become c * tanh(s / c) before the mask and softmax (Gemma 2); None: as is."""
        self.sink_logits = None if sink_logits is None else nn.Parameter(sink_logits, requires_grad=False)
        """(num_heads,) learned logits, one per head of this rank, each joining its head's softmax
        denominators (gpt-oss's attention sinks; the model loads them); None: none."""
        self.sink_tokens = 0
        """With a window: the first keys every query still sees (set by the runner's KV policy)."""
        self.kv_cache: torch.Tensor | None = None
        """Bound by the model runner, in the backend's layout (AttentionBackend.kv_cache_shape)."""
        self.backend: AttentionBackend | None = None
        self.register_buffer("kv_scale", torch.ones(2, dtype=torch.float32), persistent=False)
        """fp8 caches' per-tensor K and V scales (x = code * scale): the checkpoint's k_scale and
        v_scale, calculated from the first forward pass (`calculate_kv_scales`), or 1.0."""
        self.calculate_kv_scales = False
        self.kv_group = 0
        """The layer group whose block table this layer reads (kv_cache/hybrid.py; 0 without groups)."""

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                metadata: AttentionMetadata) -> torch.Tensor:
        """q (T, H, D), k and v (T, H_kv, D) -> (T, H * D)."""
        assert self.kv_cache is not None and self.backend is not None, "KV cache not bound"
        if metadata.groups is not None:
            metadata = metadata.groups[self.kv_group]
        if self.calculate_kv_scales:
            from kvtide.kv_compression.scales import calculate_kv_scale

            calculate_kv_scale(self, k, v)
        self.backend.write_kv(k, v, self.kv_cache, metadata.slot_mapping, self.kv_scale)
        out = self.backend.forward(q, self.kv_cache, metadata, self.scale, self.sliding_window, k, v,
                                   sink_tokens=self.sink_tokens, kv_scale=self.kv_scale,
                                   **self._soft_cap_argument, **self._sinks_argument)
        mass = metadata.attention_mass
        if mass is not None:  # the score drop policy: what each cached block received, this layer
            accumulate_attention_mass(mass, q, self.kv_cache, metadata, self.backend, self.scale,
                                      self.sliding_window, self.sink_tokens, self.kv_scale,
                                      logits_soft_cap=self.logits_soft_cap, sink_logits=self.sink_logits)
        return out.reshape(q.shape[0], self.num_heads * self.head_dim)

    @property
    def _soft_cap_argument(self) -> dict:
        """The backend's `logits_soft_cap` keyword, only for a capped layer: an uncapped one calls
        every backend as before."""
        if self.logits_soft_cap is None:
            return {}
        if not self.backend.supports_logits_soft_cap:
            raise ValueError(f"the {self.backend.name} attention backend does not apply attention logit "
                             f"soft-capping, which this model's layers need; use --attention-backend torch")
        return {"logits_soft_cap": self.logits_soft_cap}

    @property
    def _sinks_argument(self) -> dict:
        """The backend's `sink_logits` keyword, only for a layer with sinks, refused by name on a
        backend that does not apply them (never attended without)."""
        if self.sink_logits is None:
            return {}
        if not self.backend.supports_attention_sinks:
            raise ValueError(f"the {self.backend.name} attention backend does not apply attention sink logits, "
                             f"which this model's layers need; use --attention-backend torch")
        return {"sink_logits": self.sink_logits}
