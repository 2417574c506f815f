"""The Triton attention backend: the same paged KV cache and AttentionMetadata as the torch
reference, computed by the kernels in triton_kernels.py.

One kernel launch per layer covers the whole packed batch (decodes first, then prefill chunks with
or without a cached prefix), so the launch reads only device tensors and host ints already in the
metadata: no device-to-host sync, and a decode batch of fixed size launches the same grid every
step, which is what a CUDA graph needs (a layer's kv_scale is read through its pointer, so updated
values reach replays). The cache is the float layout in any float dtype, or a quantized format's
byte layout (kv_compression/formats.py), written and read by the same kernels. Checked against
torch_ref.py and formats.py in tests/attention and tests/kernels (on the CPU under TRITON_INTERPRET=1).
"""

from __future__ import annotations

import torch

from kvtide.attention.backend import AttentionBackend, AttentionMetadata
from kvtide.attention.triton_kernels import paged_attention, write_kv_cache


class TritonAttentionBackend(AttentionBackend):
    name = "triton"

    def write_kv(self, key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor,
                 slot_mapping: torch.Tensor, kv_scale: torch.Tensor | None = None) -> None:
        write_kv_cache(key, value, kv_cache, slot_mapping, self.kv_quant, kv_scale)

    def forward(self, query: torch.Tensor, kv_cache: torch.Tensor, metadata: AttentionMetadata,
                scale: float, sliding_window: int | None, key: torch.Tensor | None = None,
                value: torch.Tensor | None = None, *, sink_tokens: int = 0,
                kv_scale: torch.Tensor | None = None, logits_soft_cap: float | None = None,
                sink_logits: torch.Tensor | None = None) -> torch.Tensor:
        return paged_attention(query, kv_cache, metadata.query_start_loc, metadata.seq_lens,
                               metadata.block_tables, num_reqs=metadata.num_reqs,
                               max_query_len=metadata.max_query_len, scale=scale,
                               sliding_window=sliding_window, sink_tokens=sink_tokens,
                               kv_quant=self.kv_quant, kv_scale=kv_scale, logits_soft_cap=logits_soft_cap,
                               sink_logits=None if sink_logits is None else sink_logits.float().contiguous())
