"""A dense Llama-family model's decoder layers in one compiled call each, for decode steps on the CPU.

At batch 1 a narrow model's step is mostly fixed cost: SmolLM2 runs ~12 module calls and ~16
aten ops a layer around its GEMMs, ~150 us of interpreter time a layer on a Zen 4 core (30 layers:
~4.5 ms of a ~20-30 ms step). `decode_layer` (csrc/layer_ops.cpp) runs the same compiled ops in the
same order from one call, so the results are bit-identical to the module path's; this module
decides where it may run and feeds it.

Where: every layer a plain `LlamaDecoderLayer` (dense gated-SiLU MLP, GQA attention without q/k
norms, tensor-parallel world size 1) whose four linears each run the panel kernel (cpu_gemm's choice
at the step's row count) or the weight-only quantized kernel (int8, int4, fp8 bytes, up to its decode
row limit), the compiled element-wise ops installed (cpu_ops), float32 KV caches written and read by
the CPU backend's compiled ops. When (per step): every request row is a kernel row (no
prefill chunk longer than the kernel's query length), no KV drop policy or attention-mass
bookkeeping, one KV-group layout. Anything else takes the module path, which stays the reference.
"""

from __future__ import annotations

import logging
import os

import torch
from torch import nn

from kvtide.attention.backend import AttentionMetadata
from kvtide.attention.cpu_backend import CpuAttentionBackend
from kvtide.attention.cpu_extension import load_paged_attention
from kvtide.kv_compression.attention_mass import MASS_KEY
from kvtide.layers import cpu_gemm, layer_ops
from kvtide.layers.cpu_ops import CpuRMSNorm, CpuRotaryEmbedding, CpuSiluAndMul
from kvtide.layers.quantization import cpu_kernels
from kvtide.layers.quantization.weight_only import DECODE_MAX_ROWS, WeightOnlyMethod

logger = logging.getLogger(__name__)


class FusedDecodeLayers:
    """The per-layer arguments `decode_layer` takes, and the per-step check of whether it applies.
    Holds the layers' weights, never their KV caches (which the runner frees and rebinds)."""

    def __init__(self, layers: list[nn.Module], start: int, rows_ok: list[bool]) -> None:
        self.start = start
        """Index of layers[0] in the model (pipeline stages hold a range)."""
        self.rows_ok = rows_ok
        """rows_ok[r]: every linear runs its fused kernel at r rows (r <= cpu_gemm.MAX_DECODE_ROWS)."""
        self.attentions = [layer.self_attn.attn for layer in layers]
        self.layer_weights = [_layer_weights(layer) for layer in layers]
        """Each layer's weights and shapes, in decode_layer's argument order."""
        self._op = layer_ops.layer_op("decode_layer")
        self._attention_ns = _namespace(load_paged_attention())
        # the quantized library only where a linear runs on it (a float model never builds it)
        quantized = (cpu_kernels._op("quantized_linear")
                     if any(linear.quantized is not None for layer in layers for linear in _linears(layer)) else None)
        self._quantized_ns = _namespace(quantized) if quantized is not None else ""

    def step_caches(self, hidden_states: torch.Tensor, metadata: AttentionMetadata) -> list[torch.Tensor] | None:
        """The layers' KV caches where this step can run fused, else None."""
        rows = hidden_states.shape[0]
        if not (0 < rows < len(self.rows_ok) and self.rows_ok[rows]) or hidden_states.dtype != torch.float32 \
                or not hidden_states.is_contiguous():
            return None
        if metadata.groups is not None or metadata.has_dropped_blocks or MASS_KEY in metadata.backend_data:
            return None
        if not all(_attends_fused(attn) for attn in self.attentions):
            return None
        runs, others = CpuAttentionBackend._split_rows(metadata)
        if others or len(runs) != 1:
            return None
        return [attn.kv_cache for attn in self.attentions]

    def run(self, cos_sin: tuple[torch.Tensor, torch.Tensor], hidden_states: torch.Tensor,
            residual: torch.Tensor | None, metadata: AttentionMetadata, end: int, caches: list[torch.Tensor]
            ) -> tuple[torch.Tensor, torch.Tensor]:
        """Layers [start, end) over hidden_states (and residual: None before the model's first
        layer), with the caches `step_caches` gave for this step."""
        (block_tables, seq_lens, query_start_loc, num_rows), = CpuAttentionBackend._split_rows(metadata)[0]
        cos, sin = cos_sin
        op, namespace = self._op, self._attention_ns
        layers = end - self.start
        for weights, attn, cache in zip(self.layer_weights[:layers], self.attentions[:layers], caches[:layers],
                                      strict=True):
            first = residual is None
            if first:
                residual = hidden_states
            # window and sinks as the runner's KV policy left them (it may change them after load)
            hidden_states = op(hidden_states, residual, first, *weights, cos, sin, cache, metadata.slot_mapping,
                               block_tables, seq_lens, query_start_loc, num_rows, attn.scale,
                               attn.sliding_window or 0, attn.sink_tokens, namespace, self._quantized_ns)
        return hidden_states, residual


def _namespace(op) -> str:
    return op._qualified_op_name.split("::")[0]


def _linears(layer: nn.Module) -> tuple[nn.Module, ...]:
    return layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj


def _layer_weights(layer: nn.Module) -> tuple:
    """decode_layer's arguments from input_norm through intermediate: the norms, then the four
    linears as lists (weight panels or quantized codes, scales, mins, bias, kind, group size)."""
    attn, mlp = layer.self_attn, layer.mlp
    norm = layer.input_layernorm
    specs = [_linear_spec(linear) for linear in _linears(layer)]
    weights, scales, mins, biases, kinds, groups = (list(column) for column in zip(*specs, strict=True))
    return (norm.weight, layer.post_attention_layernorm.weight, norm.eps, weights, scales, mins, biases, kinds,
            groups, attn.num_heads, attn.num_kv_heads, mlp.down_proj.input_size_per_partition)


def _linear_spec(linear: nn.Module) -> tuple:
    if linear.quantized is not None:
        qw = linear.quantized
        return qw.codes, qw.scales, qw.mins, linear.bias, cpu_kernels.kind_code(qw), qw.group_size
    return linear.gemm_plan.packed["panels"], None, None, linear.bias, PANELS_KIND, 0


PANELS_KIND = -1
"""decode_layer's kind of a linear on weight panels (the others are the quantized op's code kinds)."""


def _linear_kernel(linear: nn.Module) -> str | None:
    """'panels', 'quantized' (the weight-only kernel on the quantized bytes), or None: neither."""
    if linear.quantized is not None:
        qw = linear.quantized
        weight_only = type(linear.quant_method).apply is WeightOnlyMethod.apply
        return ("quantized" if weight_only and qw.input_perm is None and qw.kind in cpu_kernels.KIND_CODES
                and qw.codes.device.type == "cpu" and linear.output_size == qw.out_features else None)
    if linear.gemm_plan is not None and "panels" in linear.gemm_plan.packed:
        return "panels"
    return None


def _attends_fused(attn: nn.Module) -> bool:
    """The layer's K/V go through the CPU backend's float kernels (as the module path would send them)."""
    backend, cache = attn.backend, attn.kv_cache
    return (isinstance(backend, CpuAttentionBackend) and backend.kv_quant is None and backend._op is not None
            and backend._write_float_op is not None and cache is not None and cache.dtype == torch.float32
            and cache.dim() == 5 and not attn.calculate_kv_scales)


def _eligible(layer: nn.Module, check_linears: bool = True) -> str | None:
    """Why `layer` cannot run fused, or None (its attention backend and cache are checked per step).
    check_linears=False: everything but the linears' kernels (before cpu_gemm has planned them)."""
    from kvtide.models.llama import LlamaAttention, LlamaDecoderLayer, LlamaMLP

    if type(layer) is not LlamaDecoderLayer:
        return f"{type(layer).__name__} is not a dense Llama decoder layer"
    attn, mlp = layer.self_attn, layer.mlp
    if type(attn) is not LlamaAttention or attn.q_norm is not None:
        return "attention with q/k norms or of another kind"
    if type(mlp) is not LlamaMLP or type(mlp.act_fn) is not CpuSiluAndMul:
        return "not a gated-SiLU MLP with the compiled activation"
    if not (type(layer.input_layernorm) is CpuRMSNorm and type(layer.post_attention_layernorm) is CpuRMSNorm
            and layer.input_layernorm.eps == layer.post_attention_layernorm.eps
            and type(attn.rotary_emb) is CpuRotaryEmbedding):
        return "the compiled norms and rotary are not installed"
    if attn.o_proj.tp.world_size != 1:
        return "tensor parallel"
    rotary = attn.rotary_emb
    if rotary.head_dim != attn.head_dim or rotary.cos_cache.dtype != torch.float32:
        return "rotary over part of the head or not in float32"
    for linear in _linears(layer) if check_linears else ():
        kernel = _linear_kernel(linear)
        if kernel is None:
            return "a linear on neither the panel kernel nor the weight-only quantized kernel"
        if kernel == "quantized" and not cpu_kernels.kernels_available():
            return "no compiled quantized linear"
    return None


def fused_rows(layers: list[nn.Module]) -> list[bool]:
    """rows_ok[r] for r in 0..MAX_DECODE_ROWS: every linear of every layer runs its fused kernel at
    r rows as the module path would (panels where cpu_gemm chose them; quantized bytes up to the
    weight-only path's decode row limit)."""
    run = cpu_gemm.CANDIDATES["panels"].run
    linears = [linear for layer in layers for linear in _linears(layer)]

    def runs_fused(linear: nn.Module, rows: int) -> bool:
        if linear.quantized is not None:
            return rows <= DECODE_MAX_ROWS
        return linear.gemm_plan.by_rows[rows][0] is run

    return [rows > 0 and all(runs_fused(linear, rows) for linear in linears)
            for rows in range(cpu_gemm.MAX_DECODE_ROWS + 1)]


def _llama_forward(model: nn.Module) -> bool:
    from kvtide.models.llama import LlamaForCausalLM

    return isinstance(model, LlamaForCausalLM) and type(model).forward is LlamaForCausalLM.forward


def _switched_on() -> bool:
    return os.environ.get("KVTIDE_FUSED_DECODE", "1") != "0" and layer_ops.layer_op("decode_layer") is not None


def fusable_linears(model: nn.Module) -> list[nn.Module]:
    """The decoder layers' linears where `model`'s layers could run fused once those are on the
    panel or the quantized kernel (after cpu_ops.use_cpu_ops), else []: the layers cpu_gemm should
    give panels at decode rows."""
    if not (_llama_forward(model) and _switched_on()):
        return []
    layers = list(model.layers[model.start_layer:model.end_layer])
    if not layers or any(_eligible(layer, check_linears=False) is not None for layer in layers):
        return []
    return [linear for layer in layers for linear in _linears(layer)]


def use_fused_decode(model: nn.Module) -> bool:
    """Give `model` FusedDecodeLayers where it is a Llama-family model whose every layer is eligible
    (after cpu_gemm.prepack_weights and cpu_ops.use_cpu_ops); returns whether it did. Off with
    KVTIDE_FUSED_DECODE=0."""
    if not _llama_forward(model):
        return False
    model.fused_decode = None
    if not _switched_on():
        return False
    layers = list(model.layers[model.start_layer:model.end_layer])
    reasons = {why for layer in layers if (why := _eligible(layer)) is not None}
    if load_paged_attention() is None:
        reasons.add("no compiled attention kernel")
    rows_ok = fused_rows(layers) if layers and not reasons else []
    if not any(rows_ok):
        logger.info("fused decode layers: off (%s)", "; ".join(sorted(reasons)) or "no row count runs the panel "
                    "or quantized kernel on every linear")
        return False
    model.fused_decode = FusedDecodeLayers(layers, model.start_layer, rows_ok)
    logger.info("fused decode layers: on at %s rows", ", ".join(str(r) for r, ok in enumerate(rows_ok) if ok))
    return True
