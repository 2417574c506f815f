"""MXFP4 checkpoints ("quant_method": "mxfp4", as gpt-oss is released): its MoE experts' weights in
the OCP microscaling FP4 format, kept as stored (4.25 bits a weight) and decoded one expert
projection at a time as a step routes tokens to it.

One expert weight W (E, rows, cols) is stored as two tensors:
  <name>_blocks  uint8 (E, rows, cols / 32, 16)  32 FP4 (e2m1) codes a block, two a byte, the
                                                  element of even index in the low nibble
  <name>_scales  uint8 (E, rows, cols / 32)       one e8m0 scale a block: 2 ** (s - 127)
and W[e, r, 32 * b + i] = E2M1[code i of block b] * 2 ** (scale[e, r, b] - 127). gpt-oss stores
each expert projection as (out_features, in_features), the transpose of its fused float layout:
gate_up_proj_blocks is (E, 2I, H / 32, 16) for the float (E, H, 2I), down_proj_blocks (E, H, I / 32,
16) for (E, I, H). Everything else in such a checkpoint (attention, router, embeddings, biases) is
float and loads as is.

The model's experts module (models/gpt_oss.GptOssExperts.hold_mxfp4) swaps its float parameters
for these uint8 ones when the checkpoint is MXFP4, so the whole model is never in float: a step
decodes each routed expert's two projections (a transient float copy of one expert) and multiplies.
That decode is torch's (a 256-entry table of code pairs, then the block scales), not a fused
kernel: correct and small, slower per routed expert than float weights.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from kvtide.layers.quantization.base import QuantizationConfig

E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
"""FP4 e2m1 code -> value: sign bit 3, exponent bits 2-1 (bias 1), mantissa bit 0; exponent 0 is
subnormal (0 or 0.5)."""
BLOCK = 32
"""Elements sharing one scale."""
SCALE_BIAS = 127
"""e8m0: the scale byte s means 2 ** (s - 127)."""
SUFFIXES = ("_blocks", "_scales")


_PAIR_TABLES: dict[tuple[torch.device, torch.dtype], torch.Tensor] = {}


def _pair_table(device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """(256, 2): a byte's two e2m1 values, low nibble first."""
    key = (device, dtype)
    if key not in _PAIR_TABLES:
        values = torch.tensor(E2M1_VALUES, dtype=torch.float32)
        codes = torch.arange(256)
        _PAIR_TABLES[key] = torch.stack((values[codes & 0x0F], values[codes >> 4]), dim=-1).to(device, dtype)
    return _PAIR_TABLES[key]


def dequantize_mxfp4(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """blocks (..., G, 16) uint8 and scales (..., G) uint8 -> (..., G * 32) in `dtype`."""
    if blocks.shape[:-1] != scales.shape or blocks.shape[-1] != BLOCK // 2:
        raise ValueError(f"MXFP4 blocks {tuple(blocks.shape)} and scales {tuple(scales.shape)} do not fit: "
                         f"blocks must be (..., G, {BLOCK // 2}) for scales (..., G)")
    work = torch.float32 if dtype not in (torch.float32, torch.float64) else dtype
    values = F.embedding(blocks.to(torch.int32), _pair_table(blocks.device, work))  # (..., G, 16, 2)
    # 2 ** (s - 127) is exact in float32 for every s but 0 and 255 (2 ** -127 is subnormal there,
    # and still exact; 2 ** 128 overflows, as the format's NaN scale should).
    factors = torch.exp2(scales.to(work) - SCALE_BIAS)
    return (values.flatten(-2) * factors[..., None]).flatten(-2).to(dtype)


def dequantize_expert_weight(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A gpt-oss expert projection's (E, out, in / 32, 16) codes -> its float (E, in, out) weight."""
    return dequantize_mxfp4(blocks, scales, dtype).transpose(1, 2).contiguous()


class Mxfp4Config(QuantizationConfig):
    """MXFP4 experts, held as stored by the modules that can (`hold_mxfp4`); every other layer
    stays float."""

    name = "mxfp4"
    ARCHITECTURES = ("GptOssForCausalLM",)

    @classmethod
    def from_config(cls, qc: dict[str, Any]) -> Mxfp4Config:
        return cls()

    def bind_model(self, model: nn.Module) -> None:
        super().bind_model(model)
        for module in model.modules():
            if hasattr(module, "hold_mxfp4"):
                module.hold_mxfp4()

    def method_for(self, prefix: str, layer: nn.Module) -> None:
        return None

    def check_model(self, hf_config) -> None:
        architectures = getattr(hf_config, "architectures", None) or []
        if not any(arch in self.ARCHITECTURES for arch in architectures):
            raise ValueError(f"MXFP4 checkpoints are read for {', '.join(self.ARCHITECTURES)} (its experts); "
                             f"this one is {architectures}")

    def describe(self) -> str:
        return "mxfp4 (experts held as stored, decoded per routed expert)"
