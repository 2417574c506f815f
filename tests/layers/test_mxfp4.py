"""The MXFP4 dequantizer (layers/quantization/mxfp4.py) against the format as specified: every e2m1
code's value from its bits, hand-packed bytes (low nibble first), e8m0 scales, and a round trip
through a test encoder written from the description (tests/mxfp4_codec.py)."""

from __future__ import annotations

import pytest
import torch
from mxfp4_codec import e2m1_value, encode_mxfp4

from kvtide.layers.quantization.mxfp4 import E2M1_VALUES, dequantize_expert_weight, dequantize_mxfp4


def test_the_code_table_is_e2m1():
    assert [e2m1_value(c) for c in range(16)] == list(E2M1_VALUES)
    assert E2M1_VALUES[7] == 6.0 and E2M1_VALUES[15] == -6.0 and E2M1_VALUES[1] == 0.5


def test_hand_packed_block():
    """Byte j holds element 2j in its low nibble and 2j + 1 in its high one; scale 128 is 2 ** 1."""
    codes = list(range(16)) * 2  # 32 elements: every code twice
    packed = torch.tensor([[codes[2 * j] | (codes[2 * j + 1] << 4) for j in range(16)]], dtype=torch.uint8)
    for scale_byte, factor in ((127, 1.0), (128, 2.0), (120, 2.0 ** -7)):
        out = dequantize_mxfp4(packed, torch.tensor([scale_byte], dtype=torch.uint8))
        assert out.tolist() == [e2m1_value(c) * factor for c in codes]


def test_round_trip_through_an_encoder():
    """Random weights over a wide range of block magnitudes decode to exactly what the encoder
    rounded them to, and stay within e2m1's half-step of each block's scale."""
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(3, 5, 128, generator=generator) * torch.logspace(-3, 2, 5)[None, :, None]
    blocks, scales, decoded = encode_mxfp4(x)
    assert blocks.shape == (3, 5, 4, 16) and scales.shape == (3, 5, 4)
    out = dequantize_mxfp4(blocks, scales)
    assert torch.equal(out, decoded)
    step = torch.exp2(scales.float() - 127).repeat_interleave(32, dim=-1)  # the block's unit
    assert ((out - x).abs() <= step + 1e-12).all()
    assert (out - x).abs().max() > 0  # rounding happened: the comparison above is not trivial
    # an exactly representable tensor survives unchanged
    again_blocks, again_scales, again = encode_mxfp4(out)
    assert torch.equal(dequantize_mxfp4(again_blocks, again_scales), out) and torch.equal(again, out)


def test_expert_weights_are_transposed_into_the_float_layout():
    """gpt-oss stores (E, out, in) codes for a float (E, in, out) weight."""
    weight = torch.randn(2, 64, 96)  # (E, in, out)
    blocks, scales, decoded = encode_mxfp4(weight.transpose(1, 2))
    out = dequantize_expert_weight(blocks, scales, torch.float32)
    assert out.shape == weight.shape
    assert torch.equal(out, decoded.transpose(1, 2))


def test_mismatched_shapes_are_refused():
    with pytest.raises(ValueError, match="do not fit"):
        dequantize_mxfp4(torch.zeros(4, 2, 16, dtype=torch.uint8), torch.zeros(4, 3, dtype=torch.uint8))
