"""An MXFP4 encoder for tests, written from the format: 32-element blocks, one e8m0 scale byte a
block (2 ** (s - 127)) chosen so the block's largest magnitude fits e2m1's largest (6), each element
rounded to the nearest e2m1 value (sign bit 3, exponent bits 2-1 with bias 1, mantissa bit 0), two
codes a byte with the even element in the low nibble."""

from __future__ import annotations

import torch


def e2m1_value(code: int) -> float:
    """The value of a 4-bit e2m1 code, from its bits."""
    sign = -1.0 if code & 0b1000 else 1.0
    exponent, mantissa = (code >> 1) & 0b11, code & 0b1
    if exponent == 0:
        return sign * 0.5 * mantissa  # subnormal: 0 or 0.5
    return sign * (1 + 0.5 * mantissa) * 2.0 ** (exponent - 1)


def encode_mxfp4(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x (..., 32 * G) float -> (blocks (..., G, 16) uint8, scales (..., G) uint8, the values they
    decode to (..., 32 * G) float32)."""
    magnitudes = torch.tensor([e2m1_value(c) for c in range(8)])  # 0, 0.5, ..., 6
    grouped = x.float().reshape(*x.shape[:-1], -1, 32)
    amax = grouped.abs().amax(dim=-1).clamp(min=2.0 ** -100)
    exponent = torch.ceil(torch.log2(amax / 6.0)).clamp(-127, 127)
    scaled = grouped / torch.exp2(exponent)[..., None]
    index = (scaled.abs()[..., None] - magnitudes).abs().argmin(dim=-1)  # nearest magnitude
    codes = index | ((scaled < 0).long() << 3)
    decoded = magnitudes[index] * torch.where(scaled < 0, -1.0, 1.0) * torch.exp2(exponent)[..., None]
    packed = (codes[..., 0::2] | (codes[..., 1::2] << 4)).to(torch.uint8)
    return packed, (exponent + 127).to(torch.uint8), decoded.reshape(x.shape)
