"""GGUF checkpoints kept quantized: each linear (and the token table) keeps its ggml blocks' codes
in the engine's QuantizedWeight layout instead of being dequantized to float at load.

Per tensor type: Q4_0, Q4_1, Q4_K -> int4 in groups of 32; Q2_K, Q3_K -> int4 in groups of 16 (their
sub-blocks); IQ4_NL, IQ4_XS -> iq4 (their nibbles, indices into the level grid) in groups of 32;
Q8_0, Q5_0, Q5_1, Q5_K -> int8 in groups of 32; Q6_K -> int8 in groups of 16 (gguf_codecs.py
decodes the blocks, every value exactly). F32/F16/BF16 tensors stay float. A fused layer whose shards
come in different types (llama.cpp's Q4_K_M puts Q6_K beside Q4_K) takes their kind if they share
one, else int8, and the finest group of its shards, with each shard promoted to it (qweight.promote),
so the fused projection stays one kernel call. On an accelerator iq4 and int4 in groups of 16 are
held as int8 (the Triton kernels read int8, int4 in whole 32-blocks and fp8 codes).
MXFP4 expert weights (gpt-oss) are held as their codes and scales by the experts module itself
(mxfp4.py's layout), every other MXFP4 tensor dequantized.

The iterator (models/gguf_checkpoint.py) yields for a kept-quantized tensor `<module>.gguf_codes`,
`.gguf_scales` and `.gguf_mins` in the layer's chosen layout; the parameters here receive them.
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
    quant_parameter,
)
from kvtide.layers.quantization.qweight import INT4_BLOCK, NIBBLE_KINDS, QuantizedWeight, promote
from kvtide.layers.quantization.weight_only import WeightOnlyMethod

FORMATS = {"Q4_0": ("int4", 32), "Q4_1": ("int4", 32), "Q4_K": ("int4", 32),
           "Q8_0": ("int8", 32), "Q5_0": ("int8", 32), "Q5_1": ("int8", 32), "Q5_K": ("int8", 32),
           "IQ4_NL": ("iq4", 32), "IQ4_XS": ("iq4", 32),
           "Q2_K": ("int4", 16), "Q3_K": ("int4", 16), "Q6_K": ("int8", 16)}
"""GGUF tensor type -> (kind, group size) it is kept in."""
HAS_MINS = ("Q4_0", "Q4_1", "Q5_1", "Q2_K", "Q3_K", "Q4_K", "Q5_K")
FLOAT_TYPES = ("F32", "F16", "BF16")
PARAMS = ("gguf_codes", "gguf_scales", "gguf_mins")
MXFP4_EXPERT_WEIGHTS = (".mlp.experts.gate_up_proj", ".mlp.experts.down_proj")
"""Fused expert weights a GGUF may store in MXFP4 (gpt-oss), under their transformers names."""


def layer_format(types: list[str]) -> tuple[str, int, bool] | None:
    """(kind, group size, has mins) one fused layer keeps its shards of these types in; None: float
    (a layer with any float shard, or a type kvtide only dequantizes)."""
    if not types or any(t not in FORMATS for t in types):
        return None
    kinds = {FORMATS[t][0] for t in types}
    kind = next(iter(kinds)) if len(kinds) == 1 else "int8"
    group = min(FORMATS[t][1] for t in types)
    # int4 shards promoted into int8 carry their shift of 8 in the mins.
    mins = any(t in HAS_MINS for t in types) or (kind == "int8" and "int4" in kinds)
    return kind, group, mins


class GGUFMethod(WeightOnlyMethod):
    def __init__(self, kind: str, group_size: int, has_mins: bool, gguf_types: tuple[str, ...] = ()) -> None:
        self.kind, self.group_size, self.has_mins = kind, group_size, has_mins
        self.gguf_types = gguf_types
        """The GGUF tensor type of each checkpoint shard the layer holds, in shard order."""

    def create_weights(self, layer: nn.Module) -> None:
        n, k = layer.weight.shape
        codes_cols = k // 2 if self.kind in NIBBLE_KINDS else k
        dtype = torch.uint8 if self.kind in NIBBLE_KINDS else torch.int8
        # a row-parallel rank takes whole groups of its input columns (int4 codes: 2 columns a byte)
        quant_parameter(layer, "gguf_codes", (n, codes_cols), dtype, input_dim=1, input_pack=k // codes_cols)
        quant_parameter(layer, "gguf_scales", (n, k // self.group_size), torch.float32, input_dim=1,
                        input_pack=self.group_size)
        if self.has_mins:
            quant_parameter(layer, "gguf_mins", (n, k // self.group_size), torch.float32, input_dim=1,
                            input_pack=self.group_size)
        layer.weight_shape = (n, k)
        drop_parameters(layer, "weight")

    def process_weights_after_loading(self, layer: nn.Module) -> QuantizedWeight:
        n, k = layer.weight_shape
        mins = layer.gguf_mins.data if self.has_mins else None
        qw = QuantizedWeight(self.kind, layer.gguf_codes.data, layer.gguf_scales.data, mins, self.group_size, n, k)
        if qw.codes.device.type != "cpu" and (qw.kind == "iq4" or (qw.kind == "int4" and qw.group_size % INT4_BLOCK)):
            qw = promote(qw, "int8", qw.group_size)
        drop_parameters(layer, *PARAMS)
        layer.gguf_types = self.gguf_types  # what the file stored, beside the layout it is held in
        return qw


class GGUFConfig(QuantizationConfig):
    name = "gguf"

    def __init__(self, tensor_types: dict[str, str]) -> None:
        self.tensor_types = tensor_types
        """transformers tensor name (model.layers.0.self_attn.q_proj.weight) -> GGUF type."""
        self.tensor_formats: dict[str, tuple[str, int, bool]] = {}
        """Filled by method_for: checkpoint tensor name -> the layout its layer keeps it in."""

    @classmethod
    def from_config(cls, qc: dict[str, Any]) -> GGUFConfig:
        from kvtide.models.gguf_checkpoint import gguf_tensor_types

        return cls(gguf_tensor_types(qc["model_dir"]))


    def bind_model(self, model: nn.Module) -> None:
        """Experts whose weights the file stores all in MXFP4 (gpt-oss's) are held as stored, 4-bit,
        by modules that can hold them (`hold_mxfp4`); any other type of theirs is loaded as float."""
        super().bind_model(model)
        experts = [t for name, t in self.tensor_types.items() if name.endswith(MXFP4_EXPERT_WEIGHTS)]
        if experts and all(t == "MXFP4" for t in experts):
            for module in model.modules():
                if hasattr(module, "hold_mxfp4"):
                    module.hold_mxfp4()

    def check_parallel(self, hf_config, tensor_parallel_size: int, pipeline_parallel_size: int) -> None:
        """GGUF's blocks run along input columns and are decoded into groups of 16 or 32 columns per
        row, so a column-parallel rank takes its rows and a row-parallel rank whole groups of its
        in/tp columns (every rank still decodes each tensor of the file whole, then keeps its part);
        nibble codes also need whole 32-blocks."""
        groups = [max(group, INT4_BLOCK) if kind in NIBBLE_KINDS else group
                  for kind, group in (FORMATS[t] for t in self.tensor_types.values() if t in FORMATS)]
        if tensor_parallel_size > 1 and groups:
            check_shard_widths("GGUF's quantization block of", max(groups), hf_config, tensor_parallel_size)

    def method_for(self, prefix: str, layer: nn.Module) -> QuantizeMethod | None:
        names = [f"{module}.weight" for module in checkpoint_modules(prefix, layer, self.shard_names).values()]
        types = [self.tensor_types.get(name, "missing") for name in names]
        fmt = layer_format(types)
        if fmt is None:
            return None
        for name in names:
            self.tensor_formats[name] = fmt
        return GGUFMethod(*fmt, gguf_types=tuple(types))
