"""gpt-oss (GptOssForCausalLM): a Llama-shaped decoder whose every MLP is a sparse MoE.

    embed -> N x [RMSNorm -> attention (biases, YaRN rope, sink logits; sliding or full)
                  -> RMSNorm -> MoE (router with bias, top-k, clamped SwiGLU experts with biases)]
    -> norm -> LM head

What sets it apart from Llama (llama.py, whose decoder layer, attention, loader and stage split it
reuses through their hooks):
  - attention: q, k, v and o projections with biases; layers alternate between a sliding window
    and full attention by `layer_types`; each head has a learned sink logit that joins every
    softmax denominator (checkpoint `self_attn.sinks`, kvtide's `Attention.sink_logits`).
  - MoE: the router is a linear layer with a bias; each token takes the top `num_experts_per_tok`
    router logits and softmaxes only those. Experts are stored fused, as the checkpoint holds them:
    gate_up_proj (E, H, 2I) with gate and up interleaved along the last dim (even columns gate, odd
    up), gate_up_proj_bias (E, 2I), down_proj (E, I, H), down_proj_bias (E, H). An expert computes
        gate = min(gate, limit), up = clamp(up, -limit, limit)
        out  = ((up + 1) * gate * sigmoid(alpha * gate)) @ down_proj + down_proj_bias
  The experts run in plain torch, one matmul pair per expert the step routes to (not on
  layers/moe's FusedMoE, whose w13 layout, activation and capacity/expert-parallel options do not
  cover these experts); weights are replicated on every tensor-parallel rank.

MXFP4 checkpoints (the released gpt-oss weights): each expert weight comes as `<name>_blocks` and
`<name>_scales`, dequantized to float here as both arrive (layers/quantization/mxfp4.py).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch
from torch import nn

from kvtide.distributed import get_tp_group
from kvtide.layers.linear import ReplicatedLinear, default_weight_loader, materialize
from kvtide.layers.quantization.mxfp4 import BLOCK, SUFFIXES, dequantize_expert_weight, dequantize_mxfp4
from kvtide.layers.rotary import RotaryEmbedding
from kvtide.models.llama import LlamaAttention, LlamaForCausalLM

SWIGLU_ALPHA = 1.702
"""The experts' sigmoid gain where a config predates `swiglu_alpha`."""
NOT_FUSED = "gpt-oss layers (sparse MoE with clamped SwiGLU experts, attention sink logits) have no fused decode kernel"


class GptOssAttention(LlamaAttention):
    """Llama's attention with biases on every projection and a learned sink logit per head."""

    def __init__(self, config, layer_idx: int, rotary: RotaryEmbedding) -> None:
        bias = bool(getattr(config, "attention_bias", True))
        super().__init__(config, layer_idx, 0, torch.float32, bias, bias, False, rotary)
        sinks = self.attn.sink_logits
        sinks.weight_loader = self._load_sinks

    def attention_sink_logits(self) -> torch.Tensor:
        return torch.zeros(self.qkv_proj.num_heads)

    def _load_sinks(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: object = None) -> None:
        """This rank's heads' sinks (the query heads are split over tensor-parallel ranks in order)."""
        start = get_tp_group().rank_in_group * self.num_heads
        default_weight_loader(param, loaded[start:start + self.num_heads])


class GptOssRouter(ReplicatedLinear):
    """hidden -> one logit per expert, with a bias; kept float under weight quantization."""

    never_quantize = True


class GptOssExperts(nn.Module):
    """The routed experts, in the checkpoint's fused layout (see the module docstring)."""

    def __init__(self, config) -> None:
        super().__init__()
        experts, hidden, inner = config.num_local_experts, config.hidden_size, config.intermediate_size
        self.gate_up_proj = nn.Parameter(torch.empty(experts, hidden, 2 * inner), requires_grad=False)
        self.gate_up_proj_bias = nn.Parameter(torch.empty(experts, 2 * inner), requires_grad=False)
        self.down_proj = nn.Parameter(torch.empty(experts, inner, hidden), requires_grad=False)
        self.down_proj_bias = nn.Parameter(torch.empty(experts, hidden), requires_grad=False)
        self.alpha = float(getattr(config, "swiglu_alpha", SWIGLU_ALPHA))
        self.limit = float(config.swiglu_limit)
        self.mxfp4 = False
        """The projections are held as the checkpoint's MXFP4 codes and scales (hold_mxfp4)."""

    def hold_mxfp4(self) -> None:
        """Hold the two projections as an MXFP4 checkpoint stores them, each (E, out, in) weight as
        `<name>_blocks` (E, out, in / 32, 16) and `<name>_scales` (E, out, in / 32) uint8, in place
        of the float parameters; the checkpoint's tensors then load unchanged."""
        for name in ("gate_up_proj", "down_proj"):
            experts, inner, outer = getattr(self, name).shape
            if inner % BLOCK:
                raise ValueError(f"MXFP4 experts need {name}'s input size ({inner}) to be a multiple of {BLOCK}")
            del self._parameters[name]
            self.register_parameter(name + "_blocks", nn.Parameter(
                torch.empty(experts, outer, inner // BLOCK, BLOCK // 2, dtype=torch.uint8), requires_grad=False))
            self.register_parameter(name + "_scales", nn.Parameter(
                torch.empty(experts, outer, inner // BLOCK, dtype=torch.uint8), requires_grad=False))
        self.mxfp4 = True

    def expert_weights(self, expert: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """One expert's (H, 2I) gate_up and (I, H) down weights, decoded here when held as MXFP4."""
        if not self.mxfp4:
            return self.gate_up_proj[expert], self.down_proj[expert]
        gate_up = dequantize_mxfp4(self.gate_up_proj_blocks[expert], self.gate_up_proj_scales[expert], dtype)
        down = dequantize_mxfp4(self.down_proj_blocks[expert], self.down_proj_scales[expert], dtype)
        return gate_up.T, down.T

    def activation(self, gate_up: torch.Tensor) -> torch.Tensor:
        """(N, 2I) interleaved gate/up -> (N, I): the clamped SwiGLU."""
        gate = gate_up[..., 0::2].clamp(max=self.limit)
        up = gate_up[..., 1::2].clamp(min=-self.limit, max=self.limit)
        return (up + 1) * (gate * torch.sigmoid(gate * self.alpha))

    def forward(self, x: torch.Tensor, expert_ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """x (T, H), expert_ids and weights (T, k) -> sum over each token's k experts of weight * expert(x)."""
        out = torch.zeros_like(x)
        for expert in expert_ids.unique().tolist():
            tokens, slots = torch.nonzero(expert_ids == expert, as_tuple=True)
            gate_up, down = self.expert_weights(expert, x.dtype)
            hidden = self.activation(x[tokens] @ gate_up + self.gate_up_proj_bias[expert])
            y = hidden @ down + self.down_proj_bias[expert]
            out.index_add_(0, tokens, y * weights[tokens, slots, None].to(y.dtype))
        return out


class GptOssMoE(nn.Module):
    """Router, top-k with a softmax over the chosen logits only, then the experts."""

    def __init__(self, config) -> None:
        super().__init__()
        self.top_k = config.num_experts_per_tok
        self.router = GptOssRouter(config.hidden_size, config.num_local_experts, bias=True)
        self.experts = GptOssExperts(config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logits = self.router(x)
        top_logits, expert_ids = torch.topk(logits, self.top_k, dim=-1)
        return self.experts(x, expert_ids, top_logits.softmax(dim=-1))


class GptOssForCausalLM(LlamaForCausalLM):
    """The gpt-oss decoder on the Llama model's layers, loader, stage split and fast-path declarations."""

    cuda_graph_blocker: str | None = ("gpt-oss's experts run one by one for the experts each step routes to, "
                                      "a list read on the host")

    def build_attention(self, config, layer_idx: int, max_model_len: int) -> nn.Module:
        return GptOssAttention(config, layer_idx, self.rotary_emb)

    def build_mlp(self, config, layer_idx: int) -> nn.Module:
        return GptOssMoE(config)

    def checkpoint_name(self, name: str) -> str | None:
        if name.endswith(".self_attn.sinks"):
            return name.removesuffix(".sinks") + ".attn.sink_logits"
        return name

    def fused_decode_layers(self) -> str:
        return NOT_FUSED

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        held = any(getattr(m, "mxfp4", False) for m in self.modules() if isinstance(m, GptOssExperts))
        return super().load_weights(weights if held else dequantized_experts(weights))


def dequantized_experts(weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
    """The checkpoint's tensors, with each MXFP4 pair (`<name>_blocks`, `<name>_scales`) replaced by
    `<name>` in float32 once both have been read; a pair left incomplete is an error."""
    pending: dict[str, dict[str, torch.Tensor]] = {}
    for name, tensor in weights:
        suffix = next((s for s in SUFFIXES if name.endswith(s)), None)
        if suffix is None:
            yield name, tensor
            continue
        base = name.removesuffix(suffix)
        parts = pending.setdefault(base, {})
        parts[suffix] = materialize(tensor)
        if len(parts) == len(SUFFIXES):
            del pending[base]
            yield base, dequantize_expert_weight(parts["_blocks"], parts["_scales"], torch.float32)
    if pending:
        raise ValueError(f"MXFP4 tensors without their pair: {sorted(f'{b}{s}' for b, p in pending.items() for s in p)}")
