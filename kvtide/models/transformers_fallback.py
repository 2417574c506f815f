"""The transformers fallback: a Hugging Face `*ForCausalLM` run inside kvtide.

Hugging Face's modeling code computes everything but attention (embeddings, rotary embeddings,
norms, MLPs, their multipliers); its attention modules call whatever function their config's
`_attn_implementation` names in transformers' `AttentionInterface`. We register one there that
hands each layer's q, k, v to a kvtide `Attention`, which writes K/V into the paged cache and runs
kvtide's backend, so the engine's continuous batching, prefix caching, chunked prefill and
preemption work unchanged:

    input_ids, positions (T,) ──▶ HF base model, batch 1 of T tokens, position_ids = positions
        per layer: HF q/k/v projections + rope ──▶ paged_attention_forward(module, q, k, v, ...)
                   q (1, H, T, D) ──▶ kvtide Attention[module.layer_idx](q, k, v, step metadata)
                   ◀── (1, T, H, D) ──  HF o_proj, MLP, norms
    ──▶ hidden states (T, hidden) ──▶ compute_logits: LM head on the rows the sampler needs

The step's AttentionMetadata reaches the attention function through a context variable that
`TransformersForCausalLM.forward` sets around the HF forward pass and resets after it.
"""

from __future__ import annotations

import contextlib
import contextvars
import copy
import functools
from collections.abc import Iterable
from dataclasses import dataclass

import torch
from torch import nn

from kvtide.attention.backend import AttentionMetadata
from kvtide.layers.attention import Attention
from kvtide.layers.linear import materialize
from kvtide.models.llama import sliding_window_for_layer
from kvtide.models.registry import (
    architecture_name,
    no_transformers_class_reason,
    transformers_causal_lm_names,
)

ATTENTION_IMPLEMENTATION = "kvtide_paged"
"""The name our attention function has in transformers' AttentionInterface."""


# ---- which checkpoints the fallback runs -----------------------------------------------------
def _remote_code_ref(hf_config) -> str | None:
    auto_map = getattr(hf_config, "auto_map", None) or {}
    return auto_map.get("AutoModelForCausalLM")


def transformers_unsupported_reason(hf_config, trust_remote_code: bool) -> str | None:
    """Why the fallback cannot run this checkpoint, or None: it can."""
    arch = architecture_name(hf_config)
    if getattr(hf_config, "is_encoder_decoder", False):
        return f"{arch} is an encoder-decoder model; kvtide runs decoder-only causal language models"
    ref = _remote_code_ref(hf_config)
    if ref is not None and not trust_remote_code:
        return (f"the checkpoint ships its own modeling code for {arch} (auto_map: {ref}), which kvtide "
                f"does not execute unless --trust-remote-code is given")
    if ref is None:
        known = transformers_causal_lm_names()
        import transformers

        if (known is not None and arch not in known) or getattr(transformers, arch, None) is None:
            return no_transformers_class_reason(arch)
    model_class = transformers_model_class(hf_config, trust_remote_code)
    if not getattr(model_class, "_supports_attention_backend", False):
        return (f"transformers' {model_class.__name__} does not route its attention through transformers' "
                f"attention interface (_supports_attention_backend is off), so kvtide's paged attention "
                f"cannot take its place")
    return None


def transformers_model_class(hf_config, trust_remote_code: bool) -> type:
    """The transformers class of the checkpoint: its remote code (auto_map, trusted) or the class
    transformers ships under the architecture's name."""
    ref = _remote_code_ref(hf_config)
    if ref is not None:
        if not trust_remote_code:
            raise ValueError(transformers_unsupported_reason(hf_config, trust_remote_code))
        from transformers.dynamic_module_utils import get_class_from_dynamic_module

        return get_class_from_dynamic_module(ref, hf_config._name_or_path)
    import transformers

    return getattr(transformers, architecture_name(hf_config))


# ---- the attention function HF's modules call --------------------------------------------------
@dataclass
class _Step:
    metadata: AttentionMetadata
    layers: nn.ModuleList
    """kvtide Attention per decoder layer, indexed by the HF module's layer_idx."""


_CURRENT_STEP: contextvars.ContextVar[_Step | None] = contextvars.ContextVar("kvtide_transformers_step",
                                                                             default=None)


@dataclass
class _AttentionCall:
    """One layer's attention call as HF makes it: the shapes and arguments kvtide's layer takes."""

    num_heads: int
    num_kv_heads: int
    head_dim: int
    scaling: float
    sliding_window: int | None
    softcap: float | None
    sinks: torch.Tensor | None
    """The module's own sink-logit parameter (gpt-oss's `s_aux`): the very tensor the checkpoint
    loads into later, so kvtide's layer reads it as it is loaded."""


_PROBED_CALLS: contextvars.ContextVar[dict[int, _AttentionCall] | None] = contextvars.ContextVar(
    "kvtide_transformers_probe", default=None)
"""Set while TransformersForCausalLM probes its layers' attention calls: layer_idx -> the call."""

SINK_KWARGS = ("s_aux", "sinks")
"""The names HF modules pass attention sink logits under (one per query head)."""


def paged_attention_forward(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                            attention_mask: torch.Tensor | None, dropout: float = 0.0,
                            scaling: float | None = None, **kwargs) -> tuple[torch.Tensor, None]:
    """HF's attention-function contract: query (1, H, T, D), key and value (1, H_kv, T, D) of this
    step's T new tokens -> ((1, T, H, D), no weights). The causal mask is the paged metadata's, so
    `attention_mask` is unused (transformers builds none for an implementation without a mask
    function)."""
    layer_idx = getattr(module, "layer_idx", None)
    if layer_idx is None:
        raise ValueError(f"{type(module).__name__} has no layer_idx: kvtide cannot tell which layer's KV cache "
                         f"it attends")
    batch, num_heads, num_tokens, head_dim = query.shape
    probed = _PROBED_CALLS.get()
    if probed is not None:
        if getattr(module, "is_causal", True) is False or kwargs.get("is_causal") is False:
            raise ValueError(f"{type(module).__name__} (layer {layer_idx}) attends bidirectionally; kvtide runs "
                             f"causal language models")
        sinks = next((kwargs[name] for name in SINK_KWARGS if kwargs.get(name) is not None), None)
        if sinks is not None and (not isinstance(sinks, nn.Parameter) or tuple(sinks.shape) != (num_heads,)):
            raise ValueError(f"{type(module).__name__} (layer {layer_idx}) passes attention sinks kvtide cannot "
                             f"read as one learned logit per query head")
        probed[layer_idx] = _AttentionCall(num_heads, key.shape[1], head_dim,
                                           scaling if scaling is not None else head_dim ** -0.5,
                                           kwargs.get("sliding_window"), kwargs.get("softcap"), sinks)
        return query.new_zeros(batch, num_tokens, num_heads, head_dim), None
    step = _CURRENT_STEP.get()
    if step is None:
        raise RuntimeError(f"the {ATTENTION_IMPLEMENTATION!r} attention runs only inside "
                           f"TransformersForCausalLM.forward, which provides the step's KV-cache metadata")
    attn: Attention = step.layers[layer_idx]
    if batch != 1 or num_heads != attn.num_heads or key.shape[1] != attn.num_kv_heads or head_dim != attn.head_dim:
        raise ValueError(f"layer {layer_idx} of {type(module).__name__} attends with query {tuple(query.shape)} "
                         f"and key {tuple(key.shape)}; kvtide sized its cache for {attn.num_heads} query and "
                         f"{attn.num_kv_heads} KV heads of {attn.head_dim} dims, as its first call had them")
    q = query[0].transpose(0, 1).contiguous()  # (T, H, D)
    k = key[0].transpose(0, 1).contiguous()  # (T, H_kv, D)
    v = value[0].transpose(0, 1).contiguous()
    out = attn(q, k, v, step.metadata)  # (T, H * D)
    return out.view(1, num_tokens, num_heads, head_dim), None


@functools.cache
def register_attention() -> None:
    """Make ATTENTION_IMPLEMENTATION a name HF modules can dispatch to (once per process)."""
    from transformers import AttentionInterface

    AttentionInterface.register(ATTENTION_IMPLEMENTATION, paged_attention_forward)


# ---- the model ---------------------------------------------------------------------------------
class TransformersForCausalLM(nn.Module):
    """A transformers causal LM with kvtide's paged attention: the model interface the runner
    calls (forward, compute_logits, load_weights, attention_layers) over HF's own modules."""

    start_layer = 0

    def __init__(self, config, max_model_len: int, dtype: torch.dtype, trust_remote_code: bool = False) -> None:
        super().__init__()
        why_not = transformers_unsupported_reason(config, trust_remote_code)
        if why_not is not None:
            raise ValueError(f"--model-impl transformers cannot run {architecture_name(config)}: {why_not}")
        text_config = config.get_text_config()
        register_attention()
        hf_config = copy.deepcopy(config)
        from transformers.initialization import no_init_weights

        with no_init_weights():  # every weight comes from the checkpoint; computed buffers are still built
            self.hf_model = transformers_model_class(config, trust_remote_code)._from_config(
                hf_config, attn_implementation=ATTENTION_IMPLEMENTATION, dtype=dtype)
        self.text_config = text_config
        self.architecture = architecture_name(config)
        self.tied = bool(getattr(text_config, "tie_word_embeddings", False))
        if self.tied:
            self.hf_model.tie_weights()
        calls = self._probe_attention()
        layers = []
        for i in range(text_config.num_hidden_layers):
            call = calls.get(i)
            if call is None:
                raise ValueError(f"{self.architecture}'s layer {i} does not call transformers' attention interface "
                                 f"with a layer_idx; kvtide cannot give it a KV cache")
            window = sliding_window_for_layer(text_config, i)
            if call.sliding_window != window:
                raise ValueError(f"{self.architecture}'s layer {i} attends within a window of {call.sliding_window} "
                                 f"tokens where its config declares {window}; kvtide sizes and frees the KV cache "
                                 f"by the config's")
            attn = Attention(call.num_heads, call.head_dim, call.num_kv_heads, scale=call.scaling,
                             sliding_window=window, logits_soft_cap=call.softcap)
            if call.sinks is not None:
                attn.sink_logits = call.sinks  # HF's parameter itself, filled by load_weights
            layers.append(attn)
        self.attn = nn.ModuleList(layers)

    def _probe_attention(self) -> dict[int, _AttentionCall]:
        """What each layer hands the attention function, from one token through the model (its
        weights not loaded yet: only shapes and arguments count): the cache is sized by what HF
        passes, not by config fields a model may ignore."""
        calls: dict[int, _AttentionCall] = {}
        token = _PROBED_CALLS.set(calls)
        device = next(self.hf_model.parameters()).device
        try:
            with torch.no_grad():  # not inference mode: buffers a forward pass updates stay loadable
                one = torch.zeros(1, 1, dtype=torch.long, device=device)
                self.hf_model.get_decoder()(input_ids=one, position_ids=one, use_cache=False)
        finally:
            _PROBED_CALLS.reset(token)
        return calls

    # ---- the model interface ---------------------------------------------------------------
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, metadata: AttentionMetadata,
                num_layers: int | None = None, intermediate: tuple[torch.Tensor, torch.Tensor] | None = None
                ) -> torch.Tensor:
        """input_ids, positions (T,) -> hidden states after the final norm (T, hidden_size)."""
        if num_layers is not None or intermediate is not None:
            raise ValueError("the transformers fallback runs whole models only (no early exit, no pipeline stages)")
        with self._step(metadata):
            out = self.hf_model.get_decoder()(input_ids=input_ids[None], position_ids=positions[None],
                                              use_cache=False)
        return out.last_hidden_state[0]

    @contextlib.contextmanager
    def _step(self, metadata: AttentionMetadata):
        token = _CURRENT_STEP.set(_Step(metadata, self.attn))
        try:
            yield
        finally:
            _CURRENT_STEP.reset(token)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """(N, hidden_size) -> (N, vocab_size) float32: the LM head and the logit transforms HF's
        causal-LM heads apply after it (Granite's logits_scaling, Cohere's logit_scale, Gemma's
        final soft-capping)."""
        logits = self.hf_model.get_output_embeddings()(hidden_states)
        config = self.text_config
        if getattr(config, "logits_scaling", None):
            logits = logits / config.logits_scaling
        if getattr(config, "logit_scale", None):
            logits = logits * config.logit_scale
        cap = getattr(config, "final_logit_softcapping", None)
        if cap:
            logits = torch.tanh(logits / cap) * cap
        return logits.float()

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Checkpoint tensors by their HF names (as save_pretrained writes them) into HF's modules;
        returns the names, in this module, of the parameters filled."""
        params = dict(self.hf_model.named_parameters())
        buffers = dict(self.hf_model.named_buffers())
        prefix = self.hf_model.base_model_prefix
        loaded: set[str] = set()
        for name, tensor in weights:
            if name not in params and name not in buffers and f"{prefix}.{name}" in params:
                name = f"{prefix}.{name}"  # a checkpoint of the base model alone
            target = params.get(name, buffers.get(name))
            if target is None:
                if (self.tied and name == "lm_head.weight") or "rotary_emb.inv_freq" in name:
                    continue
                raise ValueError(f"checkpoint tensor {name!r} has no matching parameter in transformers' "
                                 f"{type(self.hf_model).__name__}")
            tensor = materialize(tensor)
            if tuple(tensor.shape) != tuple(target.shape):
                raise ValueError(f"checkpoint tensor {name!r} has shape {tuple(tensor.shape)}, "
                                 f"{type(self.hf_model).__name__} expects {tuple(target.shape)}")
            with torch.no_grad():
                target.copy_(tensor.to(target.dtype))
            loaded.add(f"hf_model.{name}")
        return loaded

    def attention_layers(self) -> list[Attention]:
        """One kvtide Attention per decoder layer, in order: the runner binds their KV caches."""
        return list(self.attn)

    # ---- what the engine's fast paths may do with this model --------------------------------
    def fused_decode_layers(self) -> str:
        """Why the compiled one-call-per-layer decode (layers/fused_decode.py) does not apply."""
        return "the transformers fallback runs Hugging Face's decoder layers, which declare no fused form"

    def cuda_graph_unsupported(self) -> str | None:
        """Why decode steps are not captured as CUDA graphs (worker/cuda_graph.py)."""
        return "the transformers fallback runs Hugging Face's modeling code, not checked for graph capture"

    @property
    def cuda_graph_safe(self) -> bool:
        return False

