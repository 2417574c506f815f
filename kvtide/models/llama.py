"""Llama-family decoder: Llama, and (through small options) Mistral, Qwen2 and Qwen3.

    embed -> N x [RMSNorm -> attention (fused qkv, rope, paged KV) -> RMSNorm -> gated MLP] -> norm
    -> LM head, applied only to the positions the sampler needs.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable

import torch
from torch import nn

from kvtide.attention.backend import AttentionMetadata
from kvtide.distributed import get_pp_group, split_evenly
from kvtide.kv_compression.scales import load_checkpoint_kv_scale
from kvtide.layers.activation import SiluAndMul
from kvtide.layers.attention import Attention
from kvtide.layers.embedding import LMHead, VocabEmbedding
from kvtide.layers.fused_decode import FusedAttention, FusedDecodePlan, FusedGatedMLP
from kvtide.layers.linear import (
    MergedColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
    default_weight_loader,
    materialize,
)
from kvtide.layers.norm import RMSNorm
from kvtide.layers.rotary import RotaryEmbedding


def keeps_methods(module: nn.Module, cls: type, *names: str) -> bool:
    """Whether `module`'s class runs `cls`'s own methods `names` (a subclass or a renamed copy of
    `cls` that left them alone): then what `cls` declares about them holds for `module` too."""
    return all(getattr(type(module), name, None) is getattr(cls, name) for name in names)


class LlamaMLP(nn.Module):
    def __init__(self, hidden_size: int, intermediate_size: int, bias: bool = False) -> None:
        super().__init__()
        self.gate_up_proj = MergedColumnParallelLinear(hidden_size, [intermediate_size] * 2, bias=bias)
        self.down_proj = RowParallelLinear(intermediate_size, hidden_size, bias=bias)
        self.act_fn = SiluAndMul()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.gate_up_proj(x)))

    def fused_decode_mlp(self) -> FusedGatedMLP | str:
        """This MLP as layers/fused_decode.py runs it, or why it cannot (a subclass that changes
        forward computes something the fused kernel does not)."""
        if not keeps_methods(self, LlamaMLP, "forward"):
            return f"{type(self).__name__} changes the gated MLP's forward"
        return FusedGatedMLP(self.gate_up_proj, self.act_fn, self.down_proj)


class LlamaAttention(nn.Module):
    norm_class: type[nn.Module] = RMSNorm
    """The per-head q/k norms' class (where qk_norm is set)."""

    def __init__(self, config, layer_idx: int, max_model_len: int, dtype: torch.dtype,
                 qkv_bias: bool, o_bias: bool, qk_norm: bool, rotary: RotaryEmbedding,
                 logits_soft_cap: float | None = None) -> None:
        super().__init__()
        num_heads = config.num_attention_heads
        num_kv_heads = getattr(config, "num_key_value_heads", None) or num_heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // num_heads
        self.qkv_proj = QKVParallelLinear(config.hidden_size, self.head_dim, num_heads, num_kv_heads,
                                          bias=qkv_bias)
        self.num_heads = self.qkv_proj.num_heads
        """This rank's query and KV heads (all of them at world size 1)."""
        self.num_kv_heads = self.qkv_proj.num_kv_heads
        self.o_proj = RowParallelLinear(num_heads * self.head_dim, config.hidden_size, bias=o_bias)
        self.q_norm = self.norm_class(self.head_dim, config.rms_norm_eps) if qk_norm else None
        self.k_norm = self.norm_class(self.head_dim, config.rms_norm_eps) if qk_norm else None
        self.rotary_emb = rotary
        self.attn = Attention(self.num_heads, self.head_dim, self.num_kv_heads,
                              scale=self.attention_scale(config),
                              sliding_window=sliding_window_for_layer(config, layer_idx),
                              logits_soft_cap=logits_soft_cap, sink_logits=self.attention_sink_logits())

    def attention_scale(self, config) -> float:
        """What scores are scaled by before the softmax."""
        return self.head_dim ** -0.5

    def attention_sink_logits(self) -> torch.Tensor | None:
        """The initial value of a learned sink logit per query head of this rank (gpt-oss), which
        joins each softmax denominator; None: none (every other model)."""
        return None

    def forward(self, cos_sin: tuple[torch.Tensor, torch.Tensor], hidden_states: torch.Tensor,
                metadata: AttentionMetadata) -> torch.Tensor:
        # (T, H + 2 * H_kv, D): one view of the fused projection, then q | k | v by head (views)
        heads = self.qkv_proj(hidden_states).view(hidden_states.shape[0], -1, self.head_dim)
        qk_heads = self.num_heads + self.num_kv_heads
        v = heads[:, qk_heads:]
        if self.q_norm is not None and self.k_norm is not None:
            q = self.q_norm(heads[:, :self.num_heads])
            k = self.k_norm(heads[:, self.num_heads:qk_heads])
            q, k = self.rotary_emb(cos_sin, q, k)
        else:  # q and k neighbour in qkv: rotated together
            q, k = self.rotary_emb.forward_qk(cos_sin, heads[:, :qk_heads], self.num_heads)
        return self.o_proj(self.attn(q, k, v, metadata))

    def fused_decode_attention(self) -> FusedAttention | str:
        """This attention as layers/fused_decode.py runs it, or why it cannot: the fused kernel
        rotates q and k straight from the projection, so per-head q/k norms between them rule it out."""
        if not keeps_methods(self, LlamaAttention, "forward"):
            return f"{type(self).__name__} changes the attention's forward"
        if self.q_norm is not None:
            return "attention with q/k norms"
        if self.attn.logits_soft_cap is not None:
            return "attention logit soft-capping"
        if self.attn.sink_logits is not None:
            return "attention sink logits"
        if self.rotary_emb.head_dim != self.head_dim:
            return "rotary over part of each head (partial_rotary_factor)"
        return FusedAttention(self.qkv_proj, self.o_proj, self.rotary_emb, self.attn, self.num_heads,
                              self.num_kv_heads, self.head_dim)


class LlamaDecoderLayer(nn.Module):
    def __init__(self, config, layer_idx: int, max_model_len: int, dtype: torch.dtype,
                 qkv_bias: bool, o_bias: bool, qk_norm: bool, rotary: RotaryEmbedding,
                 mlp: nn.Module | None = None, self_attn: nn.Module | None = None) -> None:
        """`mlp` / `self_attn` replace the dense gated MLP / GQA attention (MoE and MLA models)."""
        super().__init__()
        self.self_attn = self_attn if self_attn is not None else LlamaAttention(
            config, layer_idx, max_model_len, dtype, qkv_bias, o_bias, qk_norm, rotary)
        self.mlp = mlp if mlp is not None else LlamaMLP(config.hidden_size, config.intermediate_size,
                                                        bias=getattr(config, "mlp_bias", False))
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, cos_sin: tuple[torch.Tensor, torch.Tensor], hidden_states: torch.Tensor,
                residual: torch.Tensor | None, metadata: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            residual = hidden_states
            hidden_states = self.input_layernorm(hidden_states)
        else:
            hidden_states, residual = self.input_layernorm(hidden_states, residual)
        hidden_states = self.self_attn(cos_sin, hidden_states, metadata)
        hidden_states, residual = self.post_attention_layernorm(hidden_states, residual)
        return self.mlp(hidden_states), residual

    def fused_decode_plan(self) -> FusedDecodePlan | str:
        """This layer as one compiled call at decode (layers/fused_decode.py), or why it cannot be:
        its attention and MLP each declare their fused form (`fused_decode_attention`,
        `fused_decode_mlp`); an MoE block or latent attention declares none."""
        if not keeps_methods(self, LlamaDecoderLayer, "forward"):
            return f"{type(self).__name__} changes the decoder layer's forward"
        declare_attention = getattr(self.self_attn, "fused_decode_attention", None)
        if declare_attention is None:
            return f"{type(self.self_attn).__name__} is not GQA attention with rotary embeddings"
        declare_mlp = getattr(self.mlp, "fused_decode_mlp", None)
        if declare_mlp is None:
            return f"{type(self.mlp).__name__} is not a dense gated MLP"
        attention = declare_attention()
        if isinstance(attention, str):
            return attention
        mlp = declare_mlp()
        if isinstance(mlp, str):
            return mlp
        return FusedDecodePlan(self.input_layernorm, self.post_attention_layernorm, attention, mlp)


class OtherStageLayer(nn.Module):
    """The place of a decoder layer another pipeline stage computes: no weights, never called."""


def sliding_window_for_layer(config, layer_idx: int) -> int | None:
    window = getattr(config, "sliding_window", None)
    if not window:
        return None
    layer_types = getattr(config, "layer_types", None)
    if layer_types is not None:
        return window if layer_types[layer_idx] == "sliding_attention" else None
    pattern = getattr(config, "sliding_window_pattern", None)
    if pattern:  # Gemma configs without layer_types: every pattern-th layer is global
        return window if (layer_idx + 1) % pattern else None
    if getattr(config, "use_sliding_window", True) is False:
        return None
    return window


class LlamaForCausalLM(nn.Module):
    qkv_bias = False
    """Bias on q, k, v regardless of config.attention_bias (Qwen2)."""
    o_bias_from_config = True
    """Whether config.attention_bias also puts a bias on o_proj (not in Qwen2)."""
    qk_norm = False
    fused_decode = None
    """On the CPU, the decoder layers in one compiled call each for decode steps (layers/fused_decode.py)."""
    cuda_graph_blocker: str | None = None
    """Why a decode step's forward pass cannot be captured as a CUDA graph (it reads per-step host
    values), or None: it can. Read through `cuda_graph_unsupported()`."""
    # checkpoint name -> (fused parameter name, shard id)
    packed_modules_mapping = {
        "q_proj": ("qkv_proj", "q"), "k_proj": ("qkv_proj", "k"), "v_proj": ("qkv_proj", "v"),
        "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1),
    }

    def __init__(self, config, max_model_len: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.config = config
        rotary = self.build_rotary(config, max_model_len, dtype)
        self.rotary_emb = rotary
        # Pipeline parallelism: this stage builds layers [start_layer, end_layer) (the others are
        # weightless placeholders, so parameter names keep the checkpoint's layer indices), the
        # first stage the embedding, the last the final norm and LM head.
        pp = get_pp_group()
        self.start_layer, num_local = split_evenly(config.num_hidden_layers, pp.world_size, pp.rank_in_group)
        self.end_layer = self.start_layer + num_local
        self.is_first_stage, self.is_last_stage = pp.is_first_rank, pp.is_last_rank
        tied = getattr(config, "tie_word_embeddings", False)
        self.embed_tokens = VocabEmbedding(config.vocab_size, config.hidden_size) \
            if self.is_first_stage or (tied and self.is_last_stage) else None
        qkv_bias, o_bias = self.attention_biases(config)
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(config, i, max_model_len, dtype, qkv_bias, o_bias, self.qk_norm, rotary,
                              mlp=self.build_mlp(config, i), self_attn=self.build_attention(config, i, max_model_len))
            if self.start_layer <= i < self.end_layer else OtherStageLayer()
            for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps) if self.is_last_stage else None
        self.lm_head = LMHead(config.vocab_size, config.hidden_size) if self.is_last_stage else None
        if tied and self.lm_head is not None:
            self.lm_head.tie(self.embed_tokens)
        if pp.world_size > 1:
            self.cuda_graph_blocker = "pipeline parallel: a stage's input may be the previous stage's activations"

    # ---- hooks for the decoders built on this one ------------------------------------------
    def attention_biases(self, config) -> tuple[bool, bool]:
        """(bias on q, k and v; bias on o_proj)."""
        attention_bias = bool(getattr(config, "attention_bias", False))
        return self.qkv_bias or attention_bias, attention_bias and self.o_bias_from_config

    def rotary_dim(self, config) -> int:
        """The dimensions rotary embeddings rotate per head."""
        return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads

    def build_rotary(self, config, max_model_len: int, dtype: torch.dtype) -> RotaryEmbedding:
        """The rotary embedding every layer shares (a partial one: models/phi3.py)."""
        return RotaryEmbedding(config, self.rotary_dim(config), max_model_len, dtype)

    def build_mlp(self, config, layer_idx: int) -> nn.Module | None:
        """Layer `layer_idx`'s feed-forward block; None: the dense gated MLP."""
        return None

    def build_attention(self, config, layer_idx: int, max_model_len: int) -> nn.Module | None:
        """Layer `layer_idx`'s attention block; None: GQA attention with rotary embeddings."""
        return None

    def checkpoint_name(self, name: str) -> str | None:
        """A checkpoint tensor's name (without "model.") as this model names it; None skips it."""
        return name

    def expert_shard(self, name: str) -> tuple[str, object] | None:
        """(parameter, shard id) for one expert's tensor of a stacked MoE weight, else None."""
        return None

    def required_shards(self, param_name: str) -> set[object]:
        """The shard ids a fused parameter is filled by (a plain parameter: {None})."""
        return self._fused_shards.get(param_name.split(".")[-2], {None})

    @functools.cached_property
    def _fused_shards(self) -> dict[str, set[object]]:
        shards_of: dict[str, set[object]] = {}
        for fused, shard in self.packed_modules_mapping.values():
            shards_of.setdefault(fused, set()).add(shard)
        return shards_of

    # ---- what the engine's fast paths may do with this model --------------------------------
    def fused_decode_layers(self) -> tuple[int, list[nn.Module]] | str:
        """(index of the first, this stage's decoder layers): the layers `forward` hands to
        `self.fused_decode` at decode (layers/fused_decode.py asks each for its plan), or why it
        may not: a subclass with a forward of its own does not run that loop."""
        if not keeps_methods(self, LlamaForCausalLM, "forward"):
            return f"{type(self).__name__} has a forward of its own"
        return self.start_layer, list(self.layers[self.start_layer:self.end_layer])

    def cuda_graph_unsupported(self) -> str | None:
        """Why decode steps cannot replay a captured CUDA graph (worker/cuda_graph.py), or None."""
        return self.cuda_graph_blocker

    @property
    def cuda_graph_safe(self) -> bool:
        """Whether decode steps may be captured as CUDA graphs: `cuda_graph_unsupported()` is None."""
        return self.cuda_graph_unsupported() is None

    def attention_layers(self) -> list[Attention]:
        """This stage's attention layers, in order."""
        return [layer.self_attn.attn for layer in self.layers[self.start_layer:self.end_layer]]

    def holds_checkpoint_tensor(self, name: str) -> bool:
        """Whether this pipeline stage has a parameter for checkpoint tensor `name` (no "model.")."""
        if name.startswith("layers."):
            index = int(name.split(".", 2)[1])
            return self.start_layer <= index < self.end_layer or index >= len(self.layers)  # past: MTP layers
        if name.startswith("embed_tokens."):
            return self.embed_tokens is not None
        if name.startswith(("norm.", "lm_head.")):
            return self.is_last_stage
        return True

    aux_hidden_state_layers: tuple[int, ...] = ()
    """Layers whose input (the residual stream after the layer before) a forward pass keeps in
    `aux_hidden_states`: the features an EAGLE-3 draft head reads."""

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, metadata: AttentionMetadata,
                num_layers: int | None = None,
                intermediate: tuple[torch.Tensor, torch.Tensor] | None = None
                ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """input_ids, positions (T,) -> hidden states (T, hidden_size). `num_layers` runs only the
        first layers, then the final norm (self-speculation drafts through an early exit).
        Pipeline stages: a stage after the first starts from the previous one's `intermediate`
        (hidden states, residual), and a stage before the last returns its own instead."""
        if intermediate is None:
            hidden_states, residual = self.embed_tokens(input_ids), None
        else:
            hidden_states, residual = intermediate
        cos_sin = self.rotary_emb.cos_sin(positions)
        end = self.end_layer if num_layers is None else num_layers
        aux: list[torch.Tensor] = []
        fused = self.fused_decode
        caches = None if fused is None or self.aux_hidden_state_layers else fused.step_caches(hidden_states, metadata)
        if caches is not None:
            hidden_states, residual = fused.run(cos_sin, hidden_states, residual, metadata, end, caches)
            end = self.start_layer  # every layer ran
        for i in range(self.start_layer, end):
            if i in self.aux_hidden_state_layers:
                # The first layer takes its input as the residual, which the compiled add_rms_norm
                # updates in place: keep a copy of it.
                aux.append(hidden_states.clone() if residual is None else hidden_states + residual)
            hidden_states, residual = self.layers[i](cos_sin, hidden_states, residual, metadata)
        if self.aux_hidden_state_layers:
            self.aux_hidden_states = aux
        if not self.is_last_stage:
            return hidden_states, residual
        hidden_states, _ = self.norm(hidden_states, residual)
        return hidden_states

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """(N, hidden_size) -> (N, vocab_size) float32."""
        return self.lm_head.logits(hidden_states).float()

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Load checkpoint tensors by HF name; returns the parameter names that were filled (a fused
        parameter only once every shard of it was, e.g. q, k and v)."""
        params = dict(self.named_parameters(remove_duplicate=False))
        loaded_shards: dict[str, set[object]] = {}
        tied = getattr(self.config, "tie_word_embeddings", False)
        quant_config = getattr(self, "quant_config", None)  # set by prepare_quantization
        for name, tensor in weights:
            name = self.checkpoint_name(name.removeprefix("model."))
            if name is None or "rotary_emb.inv_freq" in name or (tied and name == "lm_head.weight") \
                    or not self.holds_checkpoint_tensor(name):
                continue
            if load_checkpoint_kv_scale(self, name, tensor):  # reads a lazy tensor only when it is one
                continue
            target, shard_id = name, None
            expert = self.expert_shard(name)
            if expert is not None:
                target, shard_id = expert
            else:
                for ckpt_name, (fused, shard) in self.packed_modules_mapping.items():
                    if f".{ckpt_name}." in name:
                        target, shard_id = name.replace(ckpt_name, fused), shard
                        break
            param = params.get(target)
            if param is None or not getattr(param, "reads_slices", False):
                tensor = materialize(tensor)  # a lazy checkpoint tensor, for a loader that takes it whole
            if param is None:
                if quant_config is not None and quant_config.skip_checkpoint_tensor(name, tensor):
                    continue
                raise ValueError(f"checkpoint tensor {name!r} has no matching parameter in "
                                 f"{type(self).__name__}")
            if isinstance(tensor, torch.Tensor):
                tensor = tensor.to(param.dtype)
            getattr(param, "weight_loader", default_weight_loader)(param, tensor, shard_id)
            loaded_shards.setdefault(target, set()).add(shard_id)
        return {name for name, shards in loaded_shards.items() if shards >= self.required_shards(name)}


class MistralForCausalLM(LlamaForCausalLM):
    """Llama with a sliding attention window (config.sliding_window)."""
