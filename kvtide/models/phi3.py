"""Phi-3 (Phi-3, Phi-3.5, Phi-4-mini): the Llama decoder with fused checkpoint projections,
LongRoPE and partial rotary.

    checkpoint                      kvtide
    self_attn.qkv_proj  [q; k; v]   split by rows into q_proj, k_proj, v_proj -> QKVParallelLinear
    mlp.gate_up_proj    [gate; up]  split by rows into gate_proj, up_proj -> MergedColumnParallelLinear

Splitting into the shards Llama's loader already takes keeps tensor parallelism's per-shard row
split (each rank reads its q heads, its KV heads, its half of gate and of up). LongRoPE's table and
the partial rotary live in layers/rotary.py; the sliding window and tied embeddings come from the
config as for Llama.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch

from kvtide.layers.rotary import RotaryEmbedding, rotary_embedding
from kvtide.models.lazy_tensor import row_range
from kvtide.models.llama import LlamaForCausalLM

_SPLIT_SUFFIXES = ("weight", "bias")
"""Tensors of a fused projection split by output rows; anything else (a quantized checkpoint's
packed codes) has a layout of its own."""


class Phi3ForCausalLM(LlamaForCausalLM):
    def build_rotary(self, config, max_model_len: int, dtype: torch.dtype) -> RotaryEmbedding:
        return rotary_embedding(config, self.rotary_dim(config), max_model_len, dtype)

    def fused_checkpoint_shards(self) -> dict[str, list[tuple[str, int]]]:
        """Fused checkpoint module -> [(the module each row block belongs to, its rows)], in row order."""
        config = self.config
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        kv_heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
        return {
            "self_attn.qkv_proj": [("self_attn.q_proj", config.num_attention_heads * head_dim),
                                   ("self_attn.k_proj", kv_heads * head_dim),
                                   ("self_attn.v_proj", kv_heads * head_dim)],
            "mlp.gate_up_proj": [("mlp.gate_proj", config.intermediate_size),
                                 ("mlp.up_proj", config.intermediate_size)],
        }

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        return super().load_weights(self._split_fused(weights))

    def _split_fused(self, weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        shards_of = self.fused_checkpoint_shards()
        for name, tensor in weights:
            module, _, suffix = name.rpartition(".")
            fused = next((f for f in shards_of if module.endswith("." + f)), None)
            if fused is None:
                yield name, tensor
                continue
            if suffix not in _SPLIT_SUFFIXES:
                raise ValueError(f"checkpoint tensor {name!r}: kvtide splits Phi-3's fused {fused} only in float "
                                 f"weights; this quantized format is not supported for Phi-3")
            shards = shards_of[fused]
            total = sum(rows for _, rows in shards)
            if tensor.shape[0] != total:
                raise ValueError(f"checkpoint tensor {name!r} has {tensor.shape[0]} rows; the config gives "
                                 f"{total} ({' + '.join(str(rows) for _, rows in shards)})")
            prefix = module[: -len(fused)]
            start = 0
            for shard_module, rows in shards:
                yield f"{prefix}{shard_module}.{suffix}", row_range(tensor, start, rows)
                start += rows
