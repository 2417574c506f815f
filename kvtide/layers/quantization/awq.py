"""AWQ checkpoints (AutoAWQ / llm-awq, "version": "gemm"): 4-bit weights with a scale and zero point
per group of input columns, converted once at load into a `QuantizedWeight` (int4, mins -s*z).

Layout, per linear of N output and K input features (the transpose of torch's weight):
  qweight  int32 (K, N / 8)   eight OUTPUT columns per int32, nibble i (bits 4i..4i+3) holding
                              column 8c + [0, 2, 4, 6, 1, 3, 5, 7][i] of block c: AWQ's GEMM kernel
                              interleaves them so that one shift-and-mask yields pairs it can convert
  qzeros   int32 (G, N / 8)   the zero points, packed and interleaved the same way
  scales   float16 (G, N)
and w[n, k] = scales[k // group, n] * (q[k, n] - z[k // group, n]). AWQ's scaling of salient
channels is already folded into the stored weights, so nothing else is needed at run time.
Other packings ("gemv", "gemv_fast", "marlin", "exllama", "ipex") lay the bits out differently and
are refused, as are zero_point false and bits other than 4.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from kvtide.layers.quantization.base import (
    QuantizationConfig,
    QuantizeMethod,
    check_shard_widths,
    checkpoint_modules,
    drop_parameters,
)
from kvtide.layers.quantization.gptq import (
    checked_parameter,
    int_weight,
    name_matches,
    unpack_int32,
)
from kvtide.layers.quantization.packed_experts import PackedExpertsMethod
from kvtide.layers.quantization.qweight import QuantizedWeight
from kvtide.layers.quantization.weight_only import WeightOnlyMethod

PACK = 8
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)
"""Nibble i of an int32 holds column AWQ_ORDER[i] of its block of eight."""
AWQ_UNDO = tuple(AWQ_ORDER.index(c) for c in range(PACK))
"""Column c of a block sits in nibble AWQ_UNDO[c]."""
PARAMS = ("qweight", "qzeros", "scales")


def unpack_awq(packed: torch.Tensor) -> torch.Tensor:
    """(R, C / 8) int32 -> (R, C) codes in column order."""
    nibbles = unpack_int32(packed, 4, dim=1)
    rows, cols = nibbles.shape
    return nibbles.view(rows, cols // PACK, PACK)[:, :, list(AWQ_UNDO)].reshape(rows, cols)


class AWQMethod(WeightOnlyMethod):
    def __init__(self, group_size: int, modules: dict[object, str]) -> None:
        self.group_size, self.modules = group_size, modules

    def create_weights(self, layer: nn.Module) -> None:
        where = next(iter(self.modules.values()))
        n, k = layer.weight.shape
        group = k if self.group_size == -1 else self.group_size
        if k % group:
            raise ValueError(f"{where}: AWQ group_size {group} does not divide the input size {k}")
        if n % PACK:
            raise ValueError(f"{where}: AWQ packs 8 output columns per int32; the layer's {n} outputs are not a "
                             f"multiple of 8")
        hint = f" (the config declares 4-bit AWQ, group_size={self.group_size})"
        checked_parameter(layer, self.modules, hint, "qweight", (k, n // PACK), torch.int32,
                          output_dim=1, pack=PACK, input_dim=0)
        checked_parameter(layer, self.modules, hint, "qzeros", (k // group, n // PACK), torch.int32,
                          output_dim=1, pack=PACK, input_dim=0, input_pack=group)
        checked_parameter(layer, self.modules, hint, "scales", (k // group, n), torch.float32,
                          output_dim=1, input_dim=0, input_pack=group)
        self.group = group
        drop_parameters(layer, "weight")

    def process_weights_after_loading(self, layer: nn.Module) -> QuantizedWeight:
        qw = decode_awq(layer.qweight.data, layer.qzeros.data, layer.scales.data, self.group)
        drop_parameters(layer, *PARAMS)
        return qw


def decode_awq(qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor, group: int) -> QuantizedWeight:
    """One AWQ weight's tensors (qweight (K, N / 8), qzeros (G, N / 8), scales (G, N)) -> its
    QuantizedWeight."""
    codes = unpack_awq(qweight).t()  # (N, K)
    zeros = unpack_awq(qzeros).t()  # (N, G)
    return int_weight(codes, 4, scales.t(), zeros, group)


class AWQConfig(QuantizationConfig):
    """quantization_config {"quant_method": "awq", "bits" (or "w_bit"), "group_size" (or
    "q_group_size"), "zero_point", "version", "modules_to_not_convert"}."""

    name = "awq"

    def __init__(self, group_size: int, modules_to_not_convert: list[str] | None = None) -> None:
        if group_size != -1 and group_size < 1:
            raise ValueError(f"AWQ group_size must be -1 (per channel) or positive; got {group_size}")
        self.group_size = group_size
        self.modules_to_not_convert = list(modules_to_not_convert or [])

    @classmethod
    def from_config(cls, qc: dict[str, Any]) -> AWQConfig:
        version = str(qc.get("version", "gemm")).lower()
        if version != "gemm":
            raise ValueError(f"AWQ version {version!r} is not supported: kvtide reads AutoAWQ's GEMM packing "
                             f"(\"version\": \"gemm\"); re-export the model with version gemm")
        bits = int(qc.get("bits", qc.get("w_bit", 4)))
        if bits != 4:
            raise ValueError(f"AWQ bits must be 4; the checkpoint declares {bits}")
        if not qc.get("zero_point", True):
            raise ValueError("AWQ without zero points (zero_point false) is not supported")
        group = qc.get("group_size", qc.get("q_group_size"))
        if group is None:
            raise ValueError("an AWQ quantization_config needs group_size")
        return cls(int(group), qc.get("modules_to_not_convert"))


    def check_parallel(self, hf_config, tensor_parallel_size: int, pipeline_parallel_size: int) -> None:
        """A row-parallel rank loads its in/tp input rows with whole groups (a column-parallel rank's
        output columns must hold whole int32 words of 8: checked as each layer loads)."""
        if tensor_parallel_size > 1 and self.group_size != -1:
            check_shard_widths("AWQ group_size", self.group_size, hf_config, tensor_parallel_size)

    def experts_method_for(self, prefix: str, moe: nn.Module):
        """A MoE layer's experts load AWQ tensors (packed_experts.py) unless modules_to_not_convert
        names them."""
        if any(name_matches(prefix, skip) or skip in prefix for skip in self.modules_to_not_convert):
            return None
        return AWQExpertsMethod(self.group_size, prefix)

    def method_for(self, prefix: str, layer: nn.Module) -> QuantizeMethod | None:
        from kvtide.layers.linear import LinearBase

        if not isinstance(layer, LinearBase):  # AWQ leaves the embedding and LM head float
            return None
        modules = checkpoint_modules(prefix, layer, self.shard_names)
        kept = [any(name_matches(m, skip) or skip in m for skip in self.modules_to_not_convert)
                for m in modules.values()]
        if all(kept):
            return None
        if any(kept):
            raise ValueError(f"{prefix}: modules_to_not_convert keeps only some of the shards of this fused layer "
                             f"float ({', '.join(modules.values())})")
        return AWQMethod(self.group_size, modules)

    def describe(self) -> str:
        return f"awq g{self.group_size}"


class AWQExpertsMethod(PackedExpertsMethod):
    """A MoE layer's experts in an AWQ checkpoint (packed_experts.py)."""

    format_name = "AWQ"

    def tensor_shapes(self, n, k, group, shards):
        pack = 32 // self.bits
        return {"qweight": ((k, n // pack), torch.int32), "qzeros": ((k // group, n // pack), torch.int32),
                "scales": ((k // group, n), torch.float32)}

    def decode(self, tensors, group, where):
        return decode_awq(tensors["qweight"], tensors["qzeros"], tensors["scales"], group)
