"""DeepSeek-V2 and DeepSeek-V3: multi-head latent attention (MLA) and fine-grained MoE.

    attention: q = q_b_proj(norm(q_a_proj(x))) (or q_proj(x)), split per head into [nope | rope];
               kv_a_proj_with_mqa(x) = [latent (kv_lora_rank) | k_pe (rope, shared by all heads)];
               the cache keeps norm(latent) and rotated k_pe, one vector per token (layers/mla.py),
               and kv_b_proj's up-projections are absorbed into the query / output side at decode.
    mlp:       the first `first_k_dense_replace` layers dense; then routed experts plus
               `n_shared_experts` shared ones (one MLP that wide), added unscaled.
    routing:   V2: softmax scores, greedy or group-limited (best expert per group) top-k, times
               routed_scaling_factor (transformers ignores norm_topk_prob for V2, and so do we).
               V3: sigmoid scores, group choice and top-k on scores + e_score_correction_bias
               (the auxiliary-loss-free balancing), weights the unbiased scores, renormalized when
               norm_topk_prob, times routed_scaling_factor.

Rotary embeddings rotate interleaved pairs (x0, x1), (x2, x3), ... (V2 always; V3 unless
`rope_interleave` is false): the pairs are de-interleaved into halves first, which permutes q and
k's rope dims alike and leaves every q.k product as the checkpoint computes it.

Tensor parallel (vLLM's layout): the heads split over the TP ranks (q_b_proj / q_proj and kv_b_proj
column-parallel by heads, o_proj row-parallel: one all-reduce per attention), q_a_proj and
kv_a_proj_with_mqa replicated, so every rank writes and holds the whole latent cache (one "head"
not divided by tp) and attends its own heads over it; W_UK / W_UV are views of its kv_b_proj rows.
The routed experts are split by expert (--enable-expert-parallel) or by their intermediate
dimension (layers/moe/layer.py), the shared experts like the dense MLP. Pipeline stages split the
decoder layers (dense and sparse alike, by index).

The multi-token-prediction layers DeepSeek-V3 checkpoints carry after the last decoder layer
(`layers.{num_hidden_layers}...`: enorm, hnorm, eh_proj, a decoder layer, shared_head) are
recognised and left unloaded; they are counted in `mtp_tensors_skipped`, for a speculative
decoding head to pick up.
"""

from __future__ import annotations

import re

import torch
from torch import nn

from kvtide.attention.backend import AttentionMetadata
from kvtide.distributed import get_tp_group
from kvtide.layers.linear import ColumnParallelLinear, ReplicatedLinear, RowParallelLinear, divide
from kvtide.layers.mla import MLAAttention, mla_softmax_scale
from kvtide.layers.moe import FusedMoE
from kvtide.layers.norm import RMSNorm
from kvtide.layers.rotary import RotaryEmbedding
from kvtide.models.llama import LlamaForCausalLM
from kvtide.models.sparse_moe import SharedExpertMLP, SparseMoeBlock, expert_shard, required_expert_shards

DEEPSEEK_EXPERT_PROJS = {"gate_proj": "w1", "up_proj": "w3", "down_proj": "w2"}
LATENT_NORM_EPS = 1e-6
"""q_a_layernorm and kv_a_layernorm use RMSNorm's default eps, not config.rms_norm_eps."""
_LAYER = re.compile(r"^layers\.(\d+)\.")


def deinterleave(x: torch.Tensor) -> torch.Tensor:
    """(..., D) with rotary pairs interleaved -> the pairs' first halves, then their second halves."""
    return torch.cat((x[..., 0::2], x[..., 1::2]), dim=-1)


class DeepseekMLAAttention(nn.Module):
    def __init__(self, config, rotary: RotaryEmbedding, interleaved_rope: bool) -> None:
        super().__init__()
        hidden, heads = config.hidden_size, config.num_attention_heads
        self.num_heads = divide(heads, get_tp_group().world_size, "the attention heads")
        """This rank's heads (all of them at world size 1)."""
        self.qk_nope_head_dim = config.qk_nope_head_dim
        self.qk_rope_head_dim = config.qk_rope_head_dim
        self.qk_head_dim = config.qk_nope_head_dim + config.qk_rope_head_dim
        self.kv_lora_rank = config.kv_lora_rank
        bias = bool(getattr(config, "attention_bias", False))
        self.q_lora_rank = getattr(config, "q_lora_rank", None)
        if self.q_lora_rank:
            self.q_a_proj = ReplicatedLinear(hidden, self.q_lora_rank, bias=bias)
            self.q_a_layernorm = RMSNorm(self.q_lora_rank, LATENT_NORM_EPS)
            self.q_b_proj = ColumnParallelLinear(self.q_lora_rank, heads * self.qk_head_dim)
        else:
            self.q_proj = ColumnParallelLinear(hidden, heads * self.qk_head_dim)
        self.kv_a_proj_with_mqa = ReplicatedLinear(hidden, self.kv_lora_rank + self.qk_rope_head_dim, bias=bias)
        self.kv_a_layernorm = RMSNorm(self.kv_lora_rank, LATENT_NORM_EPS)
        self.kv_b_proj = ColumnParallelLinear(self.kv_lora_rank, heads * (self.qk_nope_head_dim + config.v_head_dim))
        self.kv_b_proj.never_quantize = True  # MLA reads its weight directly (absorbed into q and o)
        self.o_proj = RowParallelLinear(heads * config.v_head_dim, hidden, bias=bias)
        self.rotary_emb = rotary
        self.interleaved_rope = interleaved_rope
        self.attn = MLAAttention(self.num_heads, self.qk_nope_head_dim, self.qk_rope_head_dim, config.v_head_dim,
                                 self.kv_lora_rank, mla_softmax_scale(config), self.kv_b_proj)

    def forward(self, cos_sin: tuple[torch.Tensor, torch.Tensor], hidden_states: torch.Tensor,
                metadata: AttentionMetadata) -> torch.Tensor:
        num_tokens = hidden_states.shape[0]
        if self.q_lora_rank:
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(hidden_states)))
        else:
            q = self.q_proj(hidden_states)
        q = q.view(num_tokens, self.num_heads, self.qk_head_dim)
        q_nope, q_pe = q.split([self.qk_nope_head_dim, self.qk_rope_head_dim], dim=-1)
        latent, k_pe = self.kv_a_proj_with_mqa(hidden_states).split([self.kv_lora_rank, self.qk_rope_head_dim],
                                                                    dim=-1)
        latent = self.kv_a_layernorm(latent.contiguous())
        k_pe = k_pe.unsqueeze(1)
        if self.interleaved_rope:
            q_pe, k_pe = deinterleave(q_pe), deinterleave(k_pe)
        q_pe, k_pe = self.rotary_emb(cos_sin, q_pe, k_pe)
        return self.o_proj(self.attn(q_nope, q_pe, latent, k_pe[:, 0], metadata))


class DeepseekV2ForCausalLM(LlamaForCausalLM):
    packed_modules_mapping = {"gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1)}
    cuda_graph_blocker = "MLA attention is eager torch code that reads per-step host lists"
    version = 2

    def __init__(self, config, max_model_len: int, dtype: torch.dtype) -> None:
        super().__init__(config, max_model_len, dtype)
        self.mtp_tensors_skipped = 0

    def rotary_dim(self, config) -> int:
        return config.qk_rope_head_dim

    def interleaved_rope(self, config) -> bool:
        return self.version == 2 or getattr(config, "rope_interleave", True) is not False

    def build_attention(self, config, layer_idx: int, max_model_len: int) -> nn.Module:
        return DeepseekMLAAttention(config, self.rotary_emb, self.interleaved_rope(config))

    def num_routed_experts(self, config) -> int:
        return config.n_routed_experts

    def build_mlp(self, config, layer_idx: int) -> nn.Module | None:
        if layer_idx < config.first_k_dense_replace:
            return None
        shared = None
        if config.n_shared_experts:
            shared = SharedExpertMLP(config.hidden_size, config.moe_intermediate_size * config.n_shared_experts)
        return SparseMoeBlock(self.build_experts(config), config.hidden_size, router_fp32=True, shared_expert=shared)

    def build_experts(self, config) -> FusedMoE:
        grouped = getattr(config, "topk_method", "greedy") == "group_limited_greedy"
        return FusedMoE(self.num_routed_experts(config), config.num_experts_per_tok, config.hidden_size,
                        config.moe_intermediate_size, scoring_func="softmax", renormalize=False,
                        num_expert_group=config.n_group if grouped else None,
                        topk_group=config.topk_group if grouped else None, group_score="max",
                        routed_scaling_factor=config.routed_scaling_factor)

    def checkpoint_name(self, name: str) -> str | None:
        layer = _LAYER.match(name)
        if layer is not None and int(layer[1]) >= self.config.num_hidden_layers:
            self.mtp_tensors_skipped += 1  # a multi-token-prediction layer
            return None
        return (name.replace(".mlp.gate.e_score_correction_bias", ".mlp.experts.e_score_correction_bias")
                .replace(".shared_experts.", ".shared_expert."))

    def expert_shard(self, name: str) -> tuple[str, object] | None:
        return expert_shard(name, DEEPSEEK_EXPERT_PROJS)

    def required_shards(self, param_name: str) -> set[object]:
        shards = required_expert_shards(param_name, self)
        return shards if shards is not None else super().required_shards(param_name)


class DeepseekV3ForCausalLM(DeepseekV2ForCausalLM):
    version = 3

    def build_experts(self, config) -> FusedMoE:
        return FusedMoE(self.num_routed_experts(config), config.num_experts_per_tok, config.hidden_size,
                        config.moe_intermediate_size, scoring_func="sigmoid",
                        renormalize=bool(config.norm_topk_prob), num_expert_group=config.n_group,
                        topk_group=config.topk_group, group_score="top2sum", use_score_correction_bias=True,
                        routed_scaling_factor=config.routed_scaling_factor)
