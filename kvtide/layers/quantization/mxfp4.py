"""MXFP4 checkpoints ("quant_method": "mxfp4", as gpt-oss is released): its MoE experts' weights in
the OCP microscaling FP4 format, dequantized to the model's float dtype at load.

One expert weight W (E, rows, cols) is stored as two tensors:
  <name>_blocks  uint8 (E, rows, cols / 32, 16)  32 FP4 (e2m1) codes a block, two a byte, the
                                                  element of even index in the low nibble
  <name>_scales  uint8 (E, rows, cols / 32)       one e8m0 scale a block: 2 ** (s - 127)
and W[e, r, 32 * b + i] = E2M1[code i of block b] * 2 ** (scale[e, r, b] - 127). gpt-oss stores
each expert projection as (out_features, in_features), the transpose of its fused float layout:
gate_up_proj_blocks is (E, 2I, H / 32, 16) for the float (E, H, 2I), down_proj_blocks (E, H, I / 32,
16) for (E, I, H). Everything else in such a checkpoint (attention, router, embeddings, biases) is
float and loads as is.

A first step: the experts are held and computed in float after loading (4x the memory of the
packed codes for bfloat16, 8x for float32); no MXFP4 matmul kernel yet.
"""

from __future__ import annotations

from typing import Any

import torch
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


def dequantize_mxfp4(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """blocks (..., G, 16) uint8 and scales (..., G) uint8 -> (..., G * 32) in `dtype`."""
    if blocks.shape[:-1] != scales.shape or blocks.shape[-1] != BLOCK // 2:
        raise ValueError(f"MXFP4 blocks {tuple(blocks.shape)} and scales {tuple(scales.shape)} do not fit: "
                         f"blocks must be (..., G, {BLOCK // 2}) for scales (..., G)")
    table = torch.tensor(E2M1_VALUES, dtype=torch.float32, device=blocks.device)
    codes = blocks.to(torch.uint8)
    values = torch.stack((table[(codes & 0x0F).long()], table[(codes >> 4).long()]), dim=-1)  # (..., G, 16, 2)
    values = values.flatten(-2)  # (..., G, 32): low nibble first
    exponents = scales.to(torch.int32) - SCALE_BIAS
    return torch.ldexp(values, exponents[..., None].to(torch.float32)).flatten(-2).to(dtype)


def dequantize_expert_weight(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A gpt-oss expert projection's (E, out, in / 32, 16) codes -> its float (E, in, out) weight."""
    return dequantize_mxfp4(blocks, scales, dtype).transpose(1, 2).contiguous()


class Mxfp4Config(QuantizationConfig):
    """MXFP4 experts, dequantized at load by the model (models/gpt_oss.py pairs each `_blocks`
    tensor with its `_scales`); every layer here stays float."""

    name = "mxfp4"
    ARCHITECTURES = ("GptOssForCausalLM",)

    @classmethod
    def from_config(cls, qc: dict[str, Any]) -> Mxfp4Config:
        return cls()

    def method_for(self, prefix: str, layer: nn.Module) -> None:
        return None

    def check_model(self, hf_config) -> None:
        architectures = getattr(hf_config, "architectures", None) or []
        if not any(arch in self.ARCHITECTURES for arch in architectures):
            raise ValueError(f"MXFP4 checkpoints are read for {', '.join(self.ARCHITECTURES)} (its experts); "
                             f"this one is {architectures}")

    def describe(self) -> str:
        return "mxfp4 (experts dequantized at load)"
