"""A dense Llama-family model's decoder layers in one compiled call each, for decode steps on the CPU.

At batch 1 a narrow model's step is mostly fixed cost: SmolLM2 runs ~12 module calls and ~16
aten ops a layer around its GEMMs, ~150 us of interpreter time a layer on a Zen 4 core (30 layers:
~4.5 ms of a ~20-30 ms step). `decode_layer` (csrc/layer_ops.cpp) runs the same compiled ops in the
same order from one call, so the results are bit-identical to the module path's; this module
decides where it may run and feeds it.

Who: a model declares the decoder layers its forward hands over (`fused_decode_layers()`: the
standard loop), and each layer declares what it computes (`fused_decode_plan()` -> FusedDecodePlan:
pre-norm residual blocks, GQA attention without q/k norms, a dense gated MLP), or says why it cannot;
models/llama.py declares them for the Llama family. Where: tensor-parallel world size 1, each of the
four linears on the panel kernel (cpu_gemm's choice at the step's row count) or the weight-only
quantized kernel (int8, int4, fp8 bytes, up to its decode row limit), the compiled element-wise ops
installed (cpu_ops), float32 KV caches written and read by a backend's compiled float kernels
(`float_kernels_loaded()`). When (per step): every request row is a kernel row (no prefill chunk
longer than the kernel's query length), no KV drop policy or attention-mass bookkeeping, one KV-group
layout. Anything else takes the module path, which stays the reference; a model or layer that cannot
run fused says why in the log once, at load (KV caches off the float kernels: at the first step).
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass

import torch
from torch import nn

from kvtide.attention.backend import AttentionMetadata
from kvtide.attention.cpu_extension import load_paged_attention
from kvtide.layers import cpu_gemm, layer_ops
from kvtide.layers.activation import SiluAndMul
from kvtide.layers.cpu_ops import runs_compiled_ops
from kvtide.layers.norm import RMSNorm
from kvtide.layers.quantization import cpu_kernels
from kvtide.layers.quantization.weight_only import DECODE_MAX_ROWS, WeightOnlyMethod
from kvtide.layers.rotary import RotaryEmbedding

logger = logging.getLogger(__name__)


# ---- what a model declares ------------------------------------------------------------------------
@dataclass(frozen=True)
class FusedAttention:
    """GQA attention as decode_layer runs it: one fused projection to q | k | v by head (query
    heads, then KV heads, then value heads), q and k rotated together, paged attention through
    `attn` (layers/attention.py: its scale, window, sinks, backend and KV cache), `o_proj`."""
    qkv_proj: nn.Module
    o_proj: nn.Module
    rotary: nn.Module
    attn: nn.Module
    num_heads: int
    """This rank's query heads."""
    num_kv_heads: int
    head_dim: int


@dataclass(frozen=True)
class FusedGatedMLP:
    """down_proj(act(gate_up_proj(x))), act splitting the fused projection into [gate | up]."""
    gate_up_proj: nn.Module
    act: nn.Module
    down_proj: nn.Module


@dataclass(frozen=True)
class FusedDecodePlan:
    """One decoder layer as decode_layer computes it, declared by the layer's `fused_decode_plan()`:

        first layer: residual = x, x = input_norm(x);  else: residual += x, x = input_norm(residual)
        x = attention(x);  residual += x, x = post_attention_norm(residual);  x = mlp(x)

    The modules are the layer's own; their weights, kernels and KV caches are read from them."""
    input_norm: nn.Module
    post_attention_norm: nn.Module
    attention: FusedAttention
    mlp: FusedGatedMLP


# ---- running it -------------------------------------------------------------------------------------
class FusedDecodeLayers:
    """The per-layer arguments `decode_layer` takes, and the per-step check of whether it applies.
    Holds the layers' weights, never their KV caches (which the runner frees and rebinds)."""

    def __init__(self, plans: list[FusedDecodePlan], start: int, rows_ok: list[bool]) -> None:
        self.start = start
        """Index of the first planned layer in the model (pipeline stages hold a range)."""
        self.rows_ok = rows_ok
        """rows_ok[r]: every linear runs its fused kernel at r rows (r <= cpu_gemm.MAX_DECODE_ROWS)."""
        self.attentions = [plan.attention.attn for plan in plans]
        self.layer_weights = [_layer_weights(plan) for plan in plans]
        """Each layer's weights and shapes, in decode_layer's argument order."""
        self._op = layer_ops.layer_op("decode_layer")
        self._attention_ns = load_paged_attention().default.namespace
        # the quantized library only where a linear runs on it (a float model never builds it)
        quantized = any(linear.quantized is not None for plan in plans for linear in _linears(plan))
        self._quantized_ns = (cpu_kernels.op_namespace() or "") if quantized else ""
        self._said_why_not = False

    def step_caches(self, hidden_states: torch.Tensor, metadata: AttentionMetadata) -> list[torch.Tensor] | None:
        """The layers' KV caches where this step can run fused, else None."""
        rows = hidden_states.shape[0]
        if not (0 < rows < len(self.rows_ok) and self.rows_ok[rows]) or hidden_states.dtype != torch.float32 \
                or not hidden_states.is_contiguous():
            return None
        if metadata.groups is not None or metadata.has_dropped_blocks or metadata.attention_mass is not None:
            return None
        for attn in self.attentions:
            if attn.kv_cache is None or attn.calculate_kv_scales:  # not bound yet, or scales still to set
                return None
            why_not = _cache_unfit(attn)
            if why_not is not None:
                if not self._said_why_not:
                    logger.info("fused decode layers: steps take the module path (%s)", why_not)
                    self._said_why_not = True
                return None
        runs, others = self.attentions[0].backend.split_rows(metadata)
        if others or len(runs) != 1:
            return None
        return [attn.kv_cache for attn in self.attentions]

    def run(self, cos_sin: tuple[torch.Tensor, torch.Tensor], hidden_states: torch.Tensor,
            residual: torch.Tensor | None, metadata: AttentionMetadata, end: int, caches: list[torch.Tensor]
            ) -> tuple[torch.Tensor, torch.Tensor]:
        """Layers [start, end) over hidden_states (and residual: None before the model's first
        layer), with the caches `step_caches` gave for this step."""
        (block_tables, seq_lens, query_start_loc, num_rows), = self.attentions[0].backend.split_rows(metadata)[0]
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


def _linears(plan: FusedDecodePlan) -> tuple[nn.Module, ...]:
    return plan.attention.qkv_proj, plan.attention.o_proj, plan.mlp.gate_up_proj, plan.mlp.down_proj


def _layer_weights(plan: FusedDecodePlan) -> tuple:
    """decode_layer's arguments from input_norm through intermediate: the norms, then the four
    linears as lists (weight panels or quantized codes, scales, mins, bias, kind, group size)."""
    specs = [_linear_spec(linear) for linear in _linears(plan)]
    weights, scales, mins, biases, kinds, groups = (list(column) for column in zip(*specs, strict=True))
    norm = plan.input_norm
    return (norm.weight, plan.post_attention_norm.weight, norm.eps, weights, scales, mins, biases, kinds,
            groups, plan.attention.num_heads, plan.attention.num_kv_heads,
            plan.mlp.down_proj.input_size_per_partition)


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


def _cache_unfit(attn: nn.Module) -> str | None:
    """Why the layer's K/V do not go through the compiled float kernels decode_layer calls (as the
    module path would send them), or None."""
    loaded = getattr(attn.backend, "float_kernels_loaded", None)
    if loaded is None or not loaded():
        return f"the {type(attn.backend).__name__} does not run its KV cache on the compiled float kernels"
    cache = attn.kv_cache
    if cache.dtype != torch.float32 or cache.dim() != 5:
        return "the KV cache is not float32"
    return None


def _declared_plan(layer: nn.Module) -> FusedDecodePlan | str:
    declare = getattr(layer, "fused_decode_plan", None)
    return declare() if declare is not None else f"{type(layer).__name__} declares no fused decode plan"


def _unfit(plan: FusedDecodePlan | str, check_linears: bool = True) -> str | None:
    """Why a layer with this declared plan (or this reason) cannot run fused here, or None (its
    attention backend and cache are checked per step). check_linears=False: everything but the
    linears' kernels (before cpu_gemm has planned them)."""
    if isinstance(plan, str):
        return plan
    attention, mlp = plan.attention, plan.mlp
    if not runs_compiled_ops(mlp.act, SiluAndMul):
        return "not a gated-SiLU MLP with the compiled activation"
    norms = plan.input_norm, plan.post_attention_norm
    if not (all(runs_compiled_ops(norm, RMSNorm) for norm in norms) and norms[0].eps == norms[1].eps
            and runs_compiled_ops(attention.rotary, RotaryEmbedding)):
        return "the compiled norms and rotary are not installed"
    if attention.o_proj.tp.world_size != 1:
        return "tensor parallel"
    rotary = attention.rotary
    if rotary.head_dim != attention.head_dim or rotary.cos_cache.dtype != torch.float32:
        return "rotary over part of the head or not in float32"
    for linear in _linears(plan) if check_linears else ():
        kernel = _linear_kernel(linear)
        if kernel is None:
            return "a linear on neither the panel kernel nor the weight-only quantized kernel"
        if kernel == "quantized" and not cpu_kernels.kernels_available():
            return "no compiled quantized linear"
    return None


def fused_rows(plans: list[FusedDecodePlan]) -> list[bool]:
    """rows_ok[r] for r in 0..MAX_DECODE_ROWS: every linear of every layer runs its fused kernel at
    r rows as the module path would (panels where cpu_gemm chose them; quantized bytes up to the
    weight-only path's decode row limit)."""
    run = cpu_gemm.CANDIDATES["panels"].run
    linears = [linear for plan in plans for linear in _linears(plan)]

    def runs_fused(linear: nn.Module, rows: int) -> bool:
        if linear.quantized is not None:
            return rows <= DECODE_MAX_ROWS
        return linear.gemm_plan.by_rows[rows][0] is run

    return [rows > 0 and all(runs_fused(linear, rows) for linear in linears)
            for rows in range(cpu_gemm.MAX_DECODE_ROWS + 1)]


def _declared_layers(model: nn.Module) -> tuple[int, list[nn.Module]] | str:
    declare = getattr(model, "fused_decode_layers", None)
    return declare() if declare is not None else f"{type(model).__name__} declares no decoder layers to fuse"


def _switched_on() -> bool:
    return os.environ.get("KVTIDE_FUSED_DECODE", "1") != "0" and layer_ops.layer_op("decode_layer") is not None


def fusable_linears(model: nn.Module) -> list[nn.Module]:
    """The decoder layers' linears where `model`'s layers could run fused once those are on the
    panel or the quantized kernel (after cpu_ops.use_cpu_ops), else []: the layers cpu_gemm should
    give panels at decode rows."""
    declared = _declared_layers(model)
    if isinstance(declared, str) or not _switched_on():
        return []
    _, layers = declared
    plans = [_declared_plan(layer) for layer in layers]
    if not plans or any(_unfit(plan, check_linears=False) is not None for plan in plans):
        return []
    return [linear for plan in plans if not isinstance(plan, str) for linear in _linears(plan)]


def use_fused_decode(model: nn.Module) -> bool:
    """Give `model` FusedDecodeLayers where it declares its decoder layers and every one of them
    declares a plan that runs here (after cpu_gemm.prepack_weights and cpu_ops.use_cpu_ops); returns
    whether it did, and logs why not once. Off with KVTIDE_FUSED_DECODE=0."""
    declared = _declared_layers(model)
    if hasattr(model, "fused_decode_layers"):
        model.fused_decode = None
    if not _switched_on():
        return False
    start, layers = (0, []) if isinstance(declared, str) else declared
    reasons = {declared} if isinstance(declared, str) else set()
    plans: list[FusedDecodePlan] = []
    for layer in layers:
        plan = _declared_plan(layer)
        why_not = _unfit(plan)
        if why_not is not None:
            reasons.add(why_not)
        elif not isinstance(plan, str):
            plans.append(plan)
    if load_paged_attention() is None:
        reasons.add("no compiled attention kernel")
    rows_ok = fused_rows(plans) if plans and not reasons else []
    if not any(rows_ok):
        logger.info("fused decode layers: off for %s (%s)", type(model).__name__, "; ".join(sorted(reasons))
                    or "no row count runs the panel or quantized kernel on every linear")
        return False
    model.fused_decode = FusedDecodeLayers(plans, start, rows_ok)
    logger.info("fused decode layers: on at %s rows", ", ".join(str(r) for r, ok in enumerate(rows_ok) if ok))
    return True
