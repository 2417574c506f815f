"""Mixtral: the Mistral decoder with a sparse MoE block (top-2 of 8 experts, softmax routing,
renormalized) in place of every dense MLP."""

from __future__ import annotations

from torch import nn

from kvtide.layers.moe import FusedMoE
from kvtide.models.llama import MistralForCausalLM
from kvtide.models.sparse_moe import SparseMoeBlock, expert_shard, required_expert_shards

MIXTRAL_EXPERT_PROJS = {"w1": "w1", "w3": "w3", "w2": "w2"}


class MixtralForCausalLM(MistralForCausalLM):
    def build_mlp(self, config, layer_idx: int) -> nn.Module:
        experts = FusedMoE(config.num_local_experts, config.num_experts_per_tok, config.hidden_size,
                           config.intermediate_size, renormalize=True)
        if experts.dispatcher is not None:
            self.cuda_graph_blocker = "expert parallelism's dispatch reads its row counts on the host"
        return SparseMoeBlock(experts, config.hidden_size)

    def checkpoint_name(self, name: str) -> str | None:
        return name.replace(".block_sparse_moe.", ".mlp.")

    def expert_shard(self, name: str) -> tuple[str, object] | None:
        return expert_shard(name, MIXTRAL_EXPERT_PROJS)

    def required_shards(self, param_name: str) -> set[object]:
        shards = required_expert_shards(param_name, self)
        return shards if shards is not None else super().required_shards(param_name)
