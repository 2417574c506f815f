"""Gemma 2 and Gemma 3 text decoders (and the text tower of Gemma3ForConditionalGeneration).

    embed * sqrt(hidden_size) -> N x [
        x = residual + post_attention_norm(attention(input_norm(residual)))
        x = x + post_feedforward_norm(GeGLU(pre_feedforward_norm(x)))
    ] -> norm -> LM head (-> final logit soft cap)

What sets them apart from the Llama family (llama.py, whose projections, attention layer, loader and
pipeline split they reuse): four norms a layer, each scaling by (1 + weight) in float32; a tanh-GELU
gated MLP; attention scaled by query_pre_attn_scalar ** -0.5 instead of head_dim ** -0.5; sliding-
window and full layers interleaved by `layer_types`; Gemma 3 adds per-head q/k norms and gives its
sliding layers a rope base of their own; Gemma 2 soft-caps attention scores (cap * tanh(s / cap),
done by the attention backend) and both soft-cap the final logits.
"""

from __future__ import annotations

import copy

import torch
from torch import nn

from kvtide.attention.backend import AttentionMetadata
from kvtide.distributed import get_pp_group, split_evenly
from kvtide.layers.activation import GeluAndMul
from kvtide.layers.embedding import LMHead, VocabEmbedding
from kvtide.layers.linear import MergedColumnParallelLinear, RowParallelLinear
from kvtide.layers.norm import OffsetRMSNorm
from kvtide.layers.rotary import RotaryEmbedding
from kvtide.models.llama import LlamaAttention, LlamaForCausalLM, OtherStageLayer, sliding_window_for_layer

GELU_APPROXIMATIONS = {"gelu_pytorch_tanh": "tanh", "gelu_new": "tanh", "gelu_fast": "tanh", "gelu": "none"}
"""transformers' activation names -> F.gelu's `approximate` (gelu_new and gelu_fast are the same
tanh formula spelled out in Python)."""
FULL, SLIDING = "full_attention", "sliding_attention"
NOT_FUSED = "Gemma layers (four norms, GeGLU, (1 + w) norms) have no fused decode kernel"


def layer_type(config, layer_idx: int) -> str:
    """FULL or SLIDING, as sliding_window_for_layer (which the KV-cache planning also reads) decides."""
    return SLIDING if sliding_window_for_layer(config, layer_idx) is not None else FULL


def rope_config(config, kind: str):
    """A view of `config` whose rope_parameters are those of layer kind `kind`: Gemma 3 nests them by
    layer type (the sliding layers' base is rope_local_base_freq in older configs, the full ones
    carry the scaling); Gemma 2 has one set for all."""
    params = getattr(config, "rope_parameters", None) or {}
    if isinstance(params.get(kind), dict):
        chosen = dict(params[kind])
    elif kind == SLIDING and getattr(config, "rope_local_base_freq", None) is not None:
        chosen = {"rope_type": "default", "rope_theta": config.rope_local_base_freq}
    elif any(isinstance(value, dict) for value in params.values()):
        raise ValueError(f"config.rope_parameters has no entry for {kind} layers: {sorted(params)}")
    else:
        return config
    view = copy.copy(config)
    view.rope_parameters = chosen
    return view


def gelu_approximation(config) -> str:
    name = getattr(config, "hidden_activation", None) or getattr(config, "hidden_act", "gelu_pytorch_tanh")
    if name not in GELU_APPROXIMATIONS:
        raise ValueError(f"Gemma hidden_activation {name!r} is not supported; supported: "
                         f"{', '.join(GELU_APPROXIMATIONS)}")
    return GELU_APPROXIMATIONS[name]


class GemmaMLP(nn.Module):
    """GeGLU: down_proj(gelu(gate_proj(x)) * up_proj(x)), gate and up fused in one projection."""

    def __init__(self, config) -> None:
        super().__init__()
        self.gate_up_proj = MergedColumnParallelLinear(config.hidden_size, [config.intermediate_size] * 2, bias=False)
        self.down_proj = RowParallelLinear(config.intermediate_size, config.hidden_size, bias=False)
        self.act_fn = GeluAndMul(gelu_approximation(config))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.gate_up_proj(x)))


class GemmaAttention(LlamaAttention):
    """Llama's attention with Gemma's (1 + w) q/k norms, scores scaled by query_pre_attn_scalar ** -0.5,
    and (Gemma 2) a logit soft cap; one bias setting (attention_bias) for every projection."""

    norm_class = OffsetRMSNorm

    def __init__(self, config, layer_idx: int, rotary: RotaryEmbedding, qk_norm: bool,
                 logits_soft_cap: float | None) -> None:
        bias = bool(getattr(config, "attention_bias", False))
        super().__init__(config, layer_idx, 0, torch.float32, bias, bias, qk_norm, rotary,
                         logits_soft_cap=logits_soft_cap)

    def attention_scale(self, config) -> float:
        return config.query_pre_attn_scalar ** -0.5


class GemmaDecoderLayer(nn.Module):
    """Normalized before and after both attention and MLP. Like Llama's layers it passes the residual
    stream on as (layer output, residual), the sum taken by the next layer (or the final norm)."""

    def __init__(self, config, layer_idx: int, rotary: RotaryEmbedding, qk_norm: bool,
                 logits_soft_cap: float | None) -> None:
        super().__init__()
        self.layer_type = layer_type(config, layer_idx)
        self.self_attn = GemmaAttention(config, layer_idx, rotary, qk_norm, logits_soft_cap)
        self.mlp = GemmaMLP(config)
        eps = config.rms_norm_eps
        self.input_layernorm = OffsetRMSNorm(config.hidden_size, eps)
        self.post_attention_layernorm = OffsetRMSNorm(config.hidden_size, eps)
        self.pre_feedforward_layernorm = OffsetRMSNorm(config.hidden_size, eps)
        self.post_feedforward_layernorm = OffsetRMSNorm(config.hidden_size, eps)

    def forward(self, cos_sin: dict[str, tuple[torch.Tensor, torch.Tensor]], hidden_states: torch.Tensor,
                residual: torch.Tensor | None, metadata: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        """cos_sin: per layer type; residual None: this is the first layer."""
        residual = hidden_states if residual is None else hidden_states + residual
        hidden_states = self.self_attn(cos_sin[self.layer_type], self.input_layernorm(residual), metadata)
        residual = residual + self.post_attention_layernorm(hidden_states)
        hidden_states = self.mlp(self.pre_feedforward_layernorm(residual))
        return self.post_feedforward_layernorm(hidden_states), residual

    def fused_decode_plan(self) -> str:
        """Never fused: layers/fused_decode.py's kernel computes a Llama layer (two plain RMSNorms,
        SiLU MLP, no soft cap)."""
        return NOT_FUSED


class GemmaForCausalLM(LlamaForCausalLM):
    """The Gemma 2 / 3 decoder on the Llama model's loader, stage split and fast-path declarations."""

    qk_norm = False
    attention_soft_cap = False
    """Whether config.attn_logit_softcapping caps attention scores (Gemma 2; transformers' Gemma 3
    ignores the field)."""
    final_soft_cap = True
    """Whether config.final_logit_softcapping caps the logits (the CausalLM heads; not the
    multimodal Gemma 3 head)."""
    cuda_graph_blocker: str | None = "Gemma decode steps are not yet checked under CUDA graph capture"

    def __init__(self, config, max_model_len: int, dtype: torch.dtype) -> None:
        nn.Module.__init__(self)  # the Llama constructor builds Llama layers: only its methods are shared
        self.config = config
        if getattr(config, "use_bidirectional_attention", False):
            raise ValueError("Gemma with use_bidirectional_attention is an encoder; kvtide serves causal decoders")
        head_dim = self.rotary_dim(config)
        kinds = sorted({layer_type(config, i) for i in range(config.num_hidden_layers)})
        self.rotary_embs = nn.ModuleDict({kind: RotaryEmbedding(rope_config(config, kind), head_dim, max_model_len,
                                                                dtype) for kind in kinds})
        cap = getattr(config, "attn_logit_softcapping", None) if self.attention_soft_cap else None
        pp = get_pp_group()
        self.start_layer, num_local = split_evenly(config.num_hidden_layers, pp.world_size, pp.rank_in_group)
        self.end_layer = self.start_layer + num_local
        self.is_first_stage, self.is_last_stage = pp.is_first_rank, pp.is_last_rank
        tied = getattr(config, "tie_word_embeddings", False)
        self.embed_tokens = VocabEmbedding(config.vocab_size, config.hidden_size) \
            if self.is_first_stage or (tied and self.is_last_stage) else None
        self.layers = nn.ModuleList(
            GemmaDecoderLayer(config, i, self.rotary_embs[layer_type(config, i)], self.qk_norm, cap)
            if self.start_layer <= i < self.end_layer else OtherStageLayer()
            for i in range(config.num_hidden_layers))
        self.norm = OffsetRMSNorm(config.hidden_size, config.rms_norm_eps) if self.is_last_stage else None
        self.lm_head = LMHead(config.vocab_size, config.hidden_size) if self.is_last_stage else None
        if tied and self.lm_head is not None:
            self.lm_head.tie(self.embed_tokens)
        self.logit_soft_cap = getattr(config, "final_logit_softcapping", None) if self.final_soft_cap else None
        self.embed_scale = float(torch.tensor(config.hidden_size ** 0.5, dtype=dtype))
        """sqrt(hidden_size) rounded to the model's dtype first, as transformers does (sqrt(3072) is
        55.5 in bfloat16); the product is then rounded once, as with its 0-dim tensor."""

    def fused_decode_layers(self) -> str:
        return NOT_FUSED

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, metadata: AttentionMetadata,
                num_layers: int | None = None,
                intermediate: tuple[torch.Tensor, torch.Tensor] | None = None
                ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """As LlamaForCausalLM.forward (early exit at `num_layers`, pipeline stages through
        `intermediate`), with each layer rotated by its own layer type's table."""
        if intermediate is None:
            hidden_states, residual = self.embed_tokens(input_ids) * self.embed_scale, None
        else:
            hidden_states, residual = intermediate
        cos_sin = {kind: rotary.cos_sin(positions) for kind, rotary in self.rotary_embs.items()}
        end = self.end_layer if num_layers is None else num_layers
        aux: list[torch.Tensor] = []
        for i in range(self.start_layer, end):
            if i in self.aux_hidden_state_layers:
                aux.append(hidden_states.clone() if residual is None else hidden_states + residual)
            hidden_states, residual = self.layers[i](cos_sin, hidden_states, residual, metadata)
        if self.aux_hidden_state_layers:
            self.aux_hidden_states = aux
        if not self.is_last_stage:
            return hidden_states, residual
        return self.norm(hidden_states if residual is None else hidden_states + residual)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """(N, hidden_size) -> (N, vocab_size) float32, soft-capped in the logits' dtype as transformers does."""
        logits = self.lm_head.logits(hidden_states)
        if self.logit_soft_cap is not None:
            logits = torch.tanh(logits / self.logit_soft_cap) * self.logit_soft_cap
        return logits.float()


class Gemma2ForCausalLM(GemmaForCausalLM):
    attention_soft_cap = True


class Gemma3ForCausalLM(GemmaForCausalLM):
    qk_norm = True


class Gemma3ForConditionalGeneration(Gemma3ForCausalLM):
    """The text tower of the multimodal checkpoint, built from its text_config (models/registry.py
    serves that config): image inputs are not taken. Its tensors are named language_model.* (and
    model.language_model.* as transformers 5 saves them); the vision tower and projector are skipped."""

    final_soft_cap = False

    def checkpoint_name(self, name: str) -> str | None:
        if name.startswith(("vision_tower.", "multi_modal_projector.")):
            return None
        name = name.removeprefix("language_model.")
        return name.removeprefix("model.")
