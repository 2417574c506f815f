"""Qwen2-MoE and Qwen3-MoE: the Qwen2 / Qwen3 decoders with sparse MoE blocks.

Which layers are sparse: layer i unless i is in `mlp_only_layers`, and only every
`decoder_sparse_step`-th layer ((i + 1) % step == 0); the others keep a dense MLP of
`intermediate_size`. Experts are `moe_intermediate_size` wide; softmax routing, renormalized over
the top-k when `norm_topk_prob`. Qwen2-MoE adds a shared expert scaled by a sigmoid gate.
"""

from __future__ import annotations

from torch import nn

from kvtide.layers.moe import FusedMoE
from kvtide.models.qwen2 import Qwen2ForCausalLM
from kvtide.models.qwen3 import Qwen3ForCausalLM
from kvtide.models.sparse_moe import SharedExpertMLP, SparseMoeBlock, expert_shard, required_expert_shards

QWEN_EXPERT_PROJS = {"gate_proj": "w1", "up_proj": "w3", "down_proj": "w2"}


def is_sparse_layer(config, layer_idx: int) -> bool:
    return (layer_idx not in (getattr(config, "mlp_only_layers", None) or [])
            and config.num_experts > 0 and (layer_idx + 1) % config.decoder_sparse_step == 0)


class _QwenMoeMixin:
    shared_expert = False

    def build_mlp(self, config, layer_idx: int) -> nn.Module | None:
        if not is_sparse_layer(config, layer_idx):
            return None
        experts = FusedMoE(config.num_experts, config.num_experts_per_tok, config.hidden_size,
                           config.moe_intermediate_size, renormalize=bool(config.norm_topk_prob),
                           weights_in_logits_dtype=True)
        if experts.dispatcher is not None:
            self.cuda_graph_blocker = "expert parallelism's dispatch reads its row counts on the host"
        shared = None
        if self.shared_expert and config.shared_expert_intermediate_size:
            shared = SharedExpertMLP(config.hidden_size, config.shared_expert_intermediate_size)
        return SparseMoeBlock(experts, config.hidden_size, shared_expert=shared, shared_expert_gate=shared is not None)

    def expert_shard(self, name: str) -> tuple[str, object] | None:
        return expert_shard(name, QWEN_EXPERT_PROJS)

    def required_shards(self, param_name: str) -> set[object]:
        shards = required_expert_shards(param_name, self)
        return shards if shards is not None else super().required_shards(param_name)  # type: ignore[misc]


class Qwen2MoeForCausalLM(_QwenMoeMixin, Qwen2ForCausalLM):
    shared_expert = True

    def attention_biases(self, config) -> tuple[bool, bool]:
        return bool(getattr(config, "qkv_bias", True)), False


class Qwen3MoeForCausalLM(_QwenMoeMixin, Qwen3ForCausalLM):
    pass
