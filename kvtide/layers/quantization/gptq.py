"""GPTQ checkpoints (AutoGPTQ, GPTQModel, Optimum): 4- or 8-bit integer weights with a scale and
a zero point per group of input columns, converted once at load into a `QuantizedWeight`.

Layout, per linear of N output and K input features, with pack = 32 // bits:
  qweight  int32 (K / pack, N)   each int32 holds `pack` consecutive INPUT rows of one output
                                 column, row k in bits (k % pack) * bits and up (lowest first)
  qzeros   int32 (G, N / pack)   the zero points, packed the same way but along OUTPUT columns
  scales   float16 (G, N)        one scale per group and output column
  g_idx    int32 (K,)            the group of each input column (optional: k // group_size
                                 without act-order)
and w[n, k] = scales[g, n] * (q[k, n] - z[g, n]) with g = g_idx[k]. G = K / group_size
(group_size -1: one group, per channel). `checkpoint_format` "gptq" (v1, the AutoGPTQ quirk) stores
z - 1 in qzeros; "gptq_v2" stores z itself. `sym` only says how the quantizer chose z (the middle
code); the file is read the same way.

Act-order (`desc_act`) quantizes the columns in order of decreasing activation energy, so a
group's columns are scattered over K; g_idx records them. kvtide sorts the input columns by group
(a stable argsort of g_idx), which makes the groups contiguous again, and keeps that order as the
weight's `input_perm`: the layer gathers x's columns before the matmul. A fused layer (q, k, v)
runs one kernel and therefore needs one g_idx for all its shards: real checkpoints have it, since
the shards see the same input.

Conversion: 4-bit -> int4 codes q (0..15) with mins -s*z; 8-bit -> int8 codes q - 128 with mins
s*(128 - z). The helpers for packed integer codes below are shared with awq.py and
compressed_tensors.py.
"""

from __future__ import annotations

import re
from typing import Any

import torch
from torch import nn

from kvtide.layers.quantization.base import (
    QuantizationConfig,
    QuantizeMethod,
    check_shard_widths,
    checkpoint_modules,
    drop_parameters,
    loaded,
    quant_parameter,
)
from kvtide.layers.quantization.packed_experts import PackedExpertsMethod
from kvtide.layers.quantization.qweight import INT4_BLOCK, QuantizedWeight, pack_int4
from kvtide.layers.quantization.weight_only import WeightOnlyMethod

GPTQ_BITS = (4, 8)
GPTQ_FORMATS = ("gptq", "gptq_v2")
PARAMS = ("qweight", "qzeros", "scales", "g_idx")


# ---- shared by the integer formats (GPTQ, AWQ, compressed-tensors) -----------------------------
def unpack_int32(packed: torch.Tensor, bits: int, dim: int) -> torch.Tensor:
    """Split every int32 of `packed` into 32 // bits unsigned fields (lowest bits first), laid out
    consecutively along `dim`: (.., M, ..) -> (.., M * 32 // bits, ..) int32."""
    shifts = torch.arange(0, 32, bits, dtype=torch.int32, device=packed.device)
    moved = packed.to(torch.int32).movedim(dim, -1)
    # An arithmetic shift of a negative int32 drags the sign along; the mask drops it.
    fields = (moved.unsqueeze(-1) >> shifts) & ((1 << bits) - 1)
    return fields.flatten(-2).movedim(-1, dim)


def int_weight(codes: torch.Tensor, bits: int, scales: torch.Tensor, zeros: torch.Tensor,
               group_size: int, input_perm: torch.Tensor | None = None) -> QuantizedWeight:
    """The QuantizedWeight of w[n, k] = scales[n, g] * (codes[n, k] - zeros[n, g]), g = k // group_size.

    codes: (N, K) unsigned codes 0..2^bits - 1 (already in the order of input_perm, if any);
    scales, zeros: (N, K // group_size), zeros in code units (any float). 4-bit codes become int4
    where its 32-column blocks fit, else int8 (codes - 8) like 8-bit ones (codes - 128)."""
    n, k = codes.shape
    scales = scales.float().contiguous()
    zeros = zeros.float()
    if bits == 4 and k % INT4_BLOCK == 0 and group_size % INT4_BLOCK == 0:
        return QuantizedWeight("int4", pack_int4(codes.contiguous()).contiguous(), scales,
                               (-scales * zeros).contiguous(), group_size, n, k, input_perm)
    offset = 1 << (bits - 1)
    signed = (codes.to(torch.int16) - offset).to(torch.int8)
    mins = scales * (offset - zeros)
    # A symmetric 8-bit weight (z = 128 everywhere) needs no mins at all.
    return QuantizedWeight("int8", signed.contiguous(), scales, None if not mins.any() else mins.contiguous(),
                           group_size, n, k, input_perm)


def group_order(g_idx: torch.Tensor | None, in_features: int, group_size: int, where: str) -> torch.Tensor | None:
    """The input-column order that makes g_idx's groups contiguous (None: already are).

    Every group must hold exactly group_size columns, as act-order quantizers write it."""
    if g_idx is None:
        return None
    g_idx = g_idx.to(torch.int64)
    trivial = torch.arange(in_features, device=g_idx.device) // group_size
    if torch.equal(g_idx, trivial):
        return None
    groups = in_features // group_size
    counts = torch.bincount(g_idx.clamp(0, groups), minlength=groups + 1)
    if int(g_idx.min()) < 0 or int(g_idx.max()) >= groups or not bool((counts[:groups] == group_size).all()):
        raise ValueError(f"{where}: g_idx must assign each of the {groups} groups exactly {group_size} input "
                         f"columns; the checkpoint's does not")
    return torch.sort(g_idx, stable=True).indices


def local_g_idx(layer: nn.Module, g_idx: torch.Tensor | None, in_features: int, group_size: int
                ) -> torch.Tensor | None:
    """g_idx as this rank's groups: a row-parallel rank's part of it still counts the groups of the
    whole layer, and its first group is rank * in_features / group_size."""
    tp = getattr(layer, "tp", None)
    if g_idx is None or tp is None or tp.world_size == 1 or not hasattr(layer, "input_size_per_partition"):
        return g_idx
    return g_idx - tp.rank_in_group * (in_features // group_size)


def checked_parameter(layer: nn.Module, modules: dict[object, str], hint: str, name: str,
                      shape: tuple[int, ...], dtype: torch.dtype, **kwargs: Any) -> nn.Parameter:
    """quant_parameter whose loading errors name the checkpoint module (and end with `hint`)."""
    param = quant_parameter(layer, name, shape, dtype, **kwargs)
    inner = param.weight_loader  # type: ignore[attr-defined]

    def weight_loader(p: nn.Parameter, loaded: torch.Tensor, shard_id: object = None) -> None:
        try:
            inner(p, loaded, shard_id)
        except ValueError as e:
            where = modules.get(shard_id, next(iter(modules.values())))
            raise ValueError(f"{where}: {e}{hint}") from e

    param.weight_loader = weight_loader  # type: ignore[attr-defined]
    return param


def name_matches(name: str, pattern: str) -> bool:
    """A module-name pattern as the formats' skip lists write it: 're:<regex>', or a dotted name that
    is the module or one of its dotted parts ('lm_head', 'mlp.down_proj', 'model.layers.0')."""
    if pattern.startswith("re:"):
        return re.match(pattern[3:], name) is not None
    return f".{pattern}." in f".{name}."


# ---- GPTQ ---------------------------------------------------------------------------------------
class GPTQMethod(WeightOnlyMethod):
    def __init__(self, config: GPTQConfig, modules: dict[object, str]) -> None:
        self.config, self.modules = config, modules

    def create_weights(self, layer: nn.Module) -> None:
        bits, where = self.config.bits, next(iter(self.modules.values()))
        n, k = layer.weight.shape
        pack = 32 // bits
        group = k if self.config.group_size == -1 else self.config.group_size
        if k % group:
            raise ValueError(f"{where}: GPTQ group_size {group} does not divide the input size {k}")
        if k % pack or n % pack:
            raise ValueError(f"{where}: {bits}-bit GPTQ packs {pack} values per int32; the layer's {k} inputs and "
                             f"{n} outputs must both be multiples of {pack}")
        hint = f" (the config declares bits={bits}, group_size={self.config.group_size})"
        checked_parameter(layer, self.modules, hint, "qweight", (k // pack, n), torch.int32,
                          output_dim=1, input_dim=0, input_pack=pack)
        checked_parameter(layer, self.modules, hint, "qzeros", (k // group, n // pack), torch.int32,
                          output_dim=1, pack=pack, input_dim=0, input_pack=group)
        checked_parameter(layer, self.modules, hint, "scales", (k // group, n), torch.float32,
                          output_dim=1, input_dim=0, input_pack=group)
        checked_parameter(layer, self.modules, hint, "g_idx", (k,), torch.int32, output_dim=None,
                          optional=True, input_dim=0)
        self.shape, self.group = (n, k), group
        drop_parameters(layer, "weight")

    def process_weights_after_loading(self, layer: nn.Module) -> QuantizedWeight:
        k = self.shape[1]
        g_idx = local_g_idx(layer, layer.g_idx.data if loaded(layer.g_idx) else None, k, self.group)
        qw = decode_gptq(layer.qweight.data, layer.qzeros.data, layer.scales.data, g_idx, self.config.bits,
                         self.group, self.config.checkpoint_format, next(iter(self.modules.values())))
        drop_parameters(layer, *PARAMS)
        return qw


def decode_gptq(qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor, g_idx: torch.Tensor | None,
                bits: int, group: int, checkpoint_format: str, where: str) -> QuantizedWeight:
    """One GPTQ weight's tensors (qweight (K / pack, N), qzeros (G, N / pack), scales (G, N), g_idx
    (K,) or None) -> its QuantizedWeight, the input columns sorted by group under act-order."""
    k = qweight.shape[0] * (32 // bits)
    codes = unpack_int32(qweight, bits, dim=0)  # (K, N)
    zeros = unpack_int32(qzeros, bits, dim=1)  # (G, N)
    if checkpoint_format == "gptq":
        zeros = zeros + 1  # v1 stores z - 1
    perm = group_order(g_idx, k, group, where)
    codes = codes.t()
    if perm is not None:
        codes = codes.index_select(1, perm)
    return int_weight(codes, bits, scales.t(), zeros.t(), group, perm)


class GPTQConfig(QuantizationConfig):
    """quantization_config {"quant_method": "gptq", "bits", "group_size", "desc_act", "sym",
    "checkpoint_format", "lm_head", "modules_in_block_to_quantize"}."""

    name = "gptq"

    def __init__(self, bits: int, group_size: int, desc_act: bool = False, sym: bool = True,
                 checkpoint_format: str = "gptq", lm_head: bool = False,
                 modules_in_block_to_quantize: list[str] | None = None) -> None:
        if bits not in GPTQ_BITS:
            raise ValueError(f"GPTQ bits must be 4 or 8; the checkpoint declares bits={bits} (kvtide has no 2- or "
                             f"3-bit kernels)")
        if group_size != -1 and group_size < 1:
            raise ValueError(f"GPTQ group_size must be -1 (per channel) or positive; got {group_size}")
        if checkpoint_format not in GPTQ_FORMATS:
            raise ValueError(f"GPTQ checkpoint_format {checkpoint_format!r} is not supported; kvtide reads "
                             f"{' and '.join(GPTQ_FORMATS)} (re-export a Marlin/BitBLAS-packed checkpoint as gptq)")
        self.bits, self.group_size, self.desc_act, self.sym = bits, group_size, desc_act, sym
        self.checkpoint_format, self.lm_head = checkpoint_format, lm_head
        self.modules_in_block_to_quantize = modules_in_block_to_quantize
        """Layers of each block that are quantized (None: all linears); others stay float."""

    @classmethod
    def from_config(cls, qc: dict[str, Any]) -> GPTQConfig:
        if qc.get("is_marlin_format"):
            raise ValueError("this GPTQ checkpoint is stored in AutoGPTQ's Marlin layout (is_marlin_format), which "
                             "kvtide does not read; use the plain gptq export")
        if qc.get("dynamic"):
            raise ValueError("GPTQModel per-module overrides (quantization_config.dynamic) are not supported")
        if str(qc.get("pack_dtype", "int32")).removeprefix("torch.") != "int32":
            raise ValueError(f"GPTQ pack_dtype {qc['pack_dtype']!r} is not supported; kvtide reads int32 packing")
        if "bits" not in qc or "group_size" not in qc:
            raise ValueError("a GPTQ quantization_config needs bits and group_size")
        modules = qc.get("modules_in_block_to_quantize")
        if modules is not None:  # a list of lists of names, one list per sequential step
            modules = [m for step in modules for m in ([step] if isinstance(step, str) else step)]
        fmt = str(qc.get("checkpoint_format") or qc.get("format") or "gptq").lower()
        return cls(int(qc["bits"]), int(qc["group_size"]), bool(qc.get("desc_act", False)), bool(qc.get("sym", True)),
                   fmt, bool(qc.get("lm_head", False)), modules)


    def check_parallel(self, hf_config, tensor_parallel_size: int, pipeline_parallel_size: int) -> None:
        """A row-parallel rank loads its in/tp input columns: whole groups and whole int32 words of
        packed input rows. Act-order is refused: a rank's columns then belong to groups scattered
        over the whole layer, whose scales it would need all of (vLLM keeps them unsplit for its
        exllama kernel); kvtide's layout needs each rank's groups contiguous."""
        tp = tensor_parallel_size
        if tp == 1:
            return
        if self.desc_act:
            raise ValueError(f"GPTQ act-order (desc_act) checkpoints do not load tensor parallel "
                             f"(tensor_parallel_size={tp}): a row-parallel rank's input columns fall in groups "
                             f"scattered over the whole layer; serve it with tensor_parallel_size=1 (pipeline "
                             f"parallelism works) or use a checkpoint quantized without desc_act")
        if self.group_size != -1:
            check_shard_widths("GPTQ group_size", self.group_size, hf_config, tp)
        check_shard_widths(f"{self.bits}-bit GPTQ's packing (input rows per int32)", 32 // self.bits, hf_config, tp)

    def experts_method_for(self, prefix: str, moe: nn.Module):
        """A MoE layer's experts load GPTQ tensors (packed_experts.py) unless the config's module list
        leaves them out."""
        if self.modules_in_block_to_quantize is not None and not any(
                "experts." in pattern for pattern in self.modules_in_block_to_quantize):
            return None
        return GPTQExpertsMethod(self, prefix)

    def method_for(self, prefix: str, layer: nn.Module) -> QuantizeMethod | None:
        from kvtide.layers.embedding import LMHead, VocabEmbedding
        from kvtide.layers.linear import LinearBase

        if isinstance(layer, LMHead):
            return GPTQMethod(self, {None: "lm_head"}) if self.lm_head else None
        if isinstance(layer, VocabEmbedding):
            if self.lm_head and layer.tied_lm_head:
                raise ValueError("the GPTQ config quantizes lm_head, but the model ties it to the token embedding; "
                                 "kvtide keeps embeddings float and cannot load a quantized tied table")
            return None
        if not isinstance(layer, LinearBase):
            return None
        modules = checkpoint_modules(prefix, layer, self.shard_names)
        if self.modules_in_block_to_quantize is not None:
            chosen = [any(name_matches(m, pattern) for pattern in self.modules_in_block_to_quantize)
                      for m in modules.values()]
            if not any(chosen):
                return None
            if not all(chosen):
                raise ValueError(f"{prefix}: modules_in_block_to_quantize quantizes only some of the shards of this "
                                 f"fused layer ({', '.join(modules.values())})")
        return GPTQMethod(self, modules)

    def skip_checkpoint_tensor(self, name: str, tensor: torch.Tensor) -> bool:
        """AutoGPTQ writes an all-zero `.bias` for layers that have none; those are skipped."""
        if not name.endswith(".bias"):
            return False
        if torch.count_nonzero(tensor):
            raise ValueError(f"checkpoint tensor {name!r} is a non-zero bias, but the model has no bias there")
        return True

    def describe(self) -> str:
        group = "channel" if self.group_size == -1 else f"g{self.group_size}"
        return f"gptq {self.bits}-bit {group}" + (" act-order" if self.desc_act else "")


class GPTQExpertsMethod(PackedExpertsMethod):
    """A MoE layer's experts in a GPTQ checkpoint (packed_experts.py)."""

    format_name = "GPTQ"
    optional = frozenset({"g_idx"})  # absent without act-order

    def __init__(self, config, where: str) -> None:
        super().__init__(config.group_size, where)
        self.bits, self.checkpoint_format = config.bits, config.checkpoint_format

    def tensor_shapes(self, n, k, group, shards):
        pack = 32 // self.bits
        return {"qweight": ((k // pack, n), torch.int32), "qzeros": ((k // group, n // pack), torch.int32),
                "scales": ((k // group, n), torch.float32), "g_idx": ((shards, k), torch.int32)}

    def decode(self, tensors, group, where):
        g_idx = tensors.get("g_idx")
        if g_idx is not None:
            if not all(torch.equal(g_idx[0], g) for g in g_idx[1:]):
                raise ValueError(f"{where}: w1 and w3 carry different g_idx (act-order permutations); kvtide runs "
                                 f"them as one fused GEMM and needs them equal")
            g_idx = g_idx[0]
        return decode_gptq(tensors["qweight"], tensors["qzeros"], tensors["scales"], g_idx, self.bits, group,
                           self.checkpoint_format, where)
