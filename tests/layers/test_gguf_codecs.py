"""GGUF block decoding against the gguf package's own dequantizers: codes, scales and mins must
reproduce gguf.quants.dequantize for every supported type, without the module ever producing floats
from the codes itself."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.constants import GGML_QUANT_SIZES
from gguf.quants import IQ4_NL, dequantize, quantize
from gguf_reference_quants import REFERENCE_QUANTIZERS

from kvtide.layers.quantization import qweight
from kvtide.layers.quantization.gguf_codecs import SUPPORTED, check_decoded, decode_blocks

ROWS, K = 3, 512  # two K-quant super-blocks per row

# Documented output of each type: kind, codes dtype, code range, group size, whether it has mins.
EXPECTED = {
    "Q8_0": ("int8", np.int8, (-128, 127), 32, False),
    "Q4_0": ("int4", np.uint8, (0, 15), 32, True),
    "Q4_1": ("int4", np.uint8, (0, 15), 32, True),
    "Q5_0": ("int8", np.int8, (-16, 15), 32, False),
    "Q5_1": ("int8", np.int8, (0, 31), 32, True),
    "Q2_K": ("int4", np.uint8, (0, 3), 16, True),
    "Q3_K": ("int4", np.uint8, (0, 7), 16, True),  # q + 4, the shift in the mins
    "IQ4_NL": ("iq4", np.uint8, (0, 15), 32, False),  # indices into the level grid
    "IQ4_XS": ("iq4", np.uint8, (0, 15), 32, False),
    "Q4_K": ("int4", np.uint8, (0, 15), 32, True),
    "Q5_K": ("int8", np.int8, (0, 31), 32, True),
    "Q6_K": ("int8", np.int8, (-32, 31), 16, False),
}

# Byte offsets of each type's f16 fields inside its block (ggml's block_* structs), and whether
# the field may be negative (Q4_1's m is an offset; d and dmin are magnitudes in practice).
F16_FIELDS = {
    "Q8_0": [(0, False)],
    "Q4_0": [(0, False)],
    "Q4_1": [(0, False), (2, True)],
    "Q5_0": [(0, False)],
    "Q5_1": [(0, False), (2, True)],
    "Q2_K": [(80, False), (82, False)],
    "Q3_K": [(108, False)],
    "IQ4_NL": [(0, False)],
    "IQ4_XS": [(0, False)],
    "Q4_K": [(0, False), (2, False)],
    "Q5_K": [(0, False), (2, False)],
    "Q6_K": [(208, False)],
}


def qtype(name: str) -> GGMLQuantizationType:
    return GGMLQuantizationType[name]


def random_blocks(name: str, rows: int, k: int, seed: int) -> np.ndarray:
    """Valid random blocks: random bytes everywhere (every bit pattern of codes and sub-scales),
    with the f16 fields overwritten by finite values in [0.001, 0.1]."""
    rng = np.random.default_rng(seed)
    block, type_size = GGML_QUANT_SIZES[qtype(name)]
    n_blocks = rows * (k // block)
    raw = rng.integers(0, 256, size=(n_blocks, type_size), dtype=np.uint8)
    for offset, signed in F16_FIELDS[name]:
        value = rng.uniform(0.001, 0.1, size=n_blocks).astype(np.float16)
        if signed:
            value *= np.where(rng.random(n_blocks) < 0.5, -1, 1).astype(np.float16)
        raw[:, offset:offset + 2] = value.view(np.uint8).reshape(n_blocks, 2)
    return raw.reshape(rows, k // block * type_size)


def quantized_blocks(name: str, rows: int, k: int, seed: int) -> np.ndarray | None:
    """Blocks gguf's own quantizer makes from random weights, or None if it cannot make this type."""
    data = np.random.default_rng(seed).standard_normal((rows, k)).astype(np.float32) * 0.05
    try:
        return quantize(data, qtype(name))
    except NotImplementedError:
        return None


IQ4_GRID = np.array(IQ4_NL.kvalues, dtype=np.float32)
"""The IQ4 level grid as the gguf package spells it (what an iq4 code indexes)."""


def reconstruct(decoded) -> np.ndarray:
    """scales * codes + mins (iq4: scales * grid[code]), computed here independently of the module."""
    g = decoded.group_size
    numbers = IQ4_GRID[decoded.codes] if decoded.kind == "iq4" else decoded.codes.astype(np.float32)
    out = numbers * np.repeat(decoded.scales, g, axis=1)
    if decoded.mins is not None:
        out = out + np.repeat(decoded.mins, g, axis=1)
    return out


def assert_matches_gguf(raw: np.ndarray, name: str) -> None:
    decoded = decode_blocks(raw, name, K)
    kind, dtype, (lo, hi), group, has_mins = EXPECTED[name]
    assert decoded.kind == kind
    assert decoded.group_size == group
    assert decoded.codes.dtype == dtype and decoded.codes.shape == (ROWS, K)
    assert decoded.codes.min() >= lo and decoded.codes.max() <= hi
    assert decoded.scales.dtype == np.float32 and decoded.scales.shape == (ROWS, K // group)
    if has_mins:
        assert decoded.mins.dtype == np.float32 and decoded.mins.shape == (ROWS, K // group)
    else:
        assert decoded.mins is None
    reference = dequantize(raw, qtype(name))
    assert reference.shape == (ROWS, K)
    got = reconstruct(decoded)
    np.testing.assert_allclose(got, reference, rtol=0, atol=1e-6 * np.abs(reference).max())
    assert np.abs(reference).max() > 0  # a non-trivial tensor


@pytest.mark.parametrize("name", SUPPORTED)
def test_random_blocks_match_gguf_dequantize(name):
    raw = random_blocks(name, ROWS, K, seed=SUPPORTED.index(name))
    assert_matches_gguf(raw, name)
    # Random bytes cover the whole code range (catches a dropped high bit or a wrong shift).
    decoded = decode_blocks(raw, name, K)
    lo, hi = EXPECTED[name][2]
    assert decoded.codes.min() == lo and decoded.codes.max() == hi


GGUF_QUANTIZABLE = ("Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1")
"""The types the gguf package itself can quantize (its K-quants and IQ types are dequantize-only);
those are covered by the random blocks above and by tests/gguf_reference_quants.py's quantizers."""


@pytest.mark.parametrize("name", GGUF_QUANTIZABLE)
def test_gguf_quantized_weights_match_gguf_dequantize(name):
    raw = quantized_blocks(name, ROWS, K, seed=10 + SUPPORTED.index(name))
    assert raw is not None, f"gguf can no longer quantize {name}"
    assert_matches_gguf(raw, name)


@pytest.mark.parametrize("name", sorted(REFERENCE_QUANTIZERS))
def test_reference_quantized_weights_match_gguf_dequantize(name):
    weights = np.random.default_rng(30 + SUPPORTED.index(name)).standard_normal((ROWS, K)).astype(np.float32) * 0.05
    raw, _ = REFERENCE_QUANTIZERS[name](weights)
    assert_matches_gguf(raw, name)


def test_block_sizes_agree_with_ggml():
    for name in SUPPORTED:
        block, type_size = GGML_QUANT_SIZES[qtype(name)]
        decode_blocks(np.zeros((1, type_size), np.uint8), name, block)
        with pytest.raises(ValueError):
            decode_blocks(np.zeros((1, type_size + 1), np.uint8), name, block)


def test_q4_0_nibble_order_by_hand():
    # Byte j: low nibble j, high nibble 15 - j -> weights 0..15 are 0..15, weights 16..31 are 15..0.
    d = np.float16(0.5)
    qs = (np.arange(16) | ((15 - np.arange(16)) << 4)).astype(np.uint8)
    raw = np.concatenate([np.frombuffer(d.tobytes(), np.uint8), qs])[None]
    decoded = decode_blocks(raw, "Q4_0", 32)
    np.testing.assert_array_equal(decoded.codes[0], np.r_[np.arange(16), np.arange(15, -1, -1)])
    assert decoded.scales[0, 0] == 0.5 and decoded.mins[0, 0] == -4.0


def test_multi_dim_raw_is_flattened_to_rows():
    raw = random_blocks("Q6_K", 6, 256, seed=3)
    flat = decode_blocks(raw, "Q6_K", 256)
    nested = decode_blocks(raw.reshape(2, 3, -1), "Q6_K", 256)
    assert nested.codes.shape == (6, 256)
    np.testing.assert_array_equal(nested.codes, flat.codes)
    np.testing.assert_array_equal(nested.scales, flat.scales)


def test_bad_input_raises():
    raw = random_blocks("Q8_0", 2, 64, seed=0)
    with pytest.raises(ValueError, match="IQ2_XXS"):
        decode_blocks(raw, "IQ2_XXS", 64)
    with pytest.raises(ValueError, match="bytes"):
        decode_blocks(raw, "Q8_0", 96)  # 96 weights would take 102 bytes, not 68
    with pytest.raises(ValueError, match="bytes"):
        decode_blocks(raw[:, :-1], "Q8_0", 64)
    with pytest.raises(ValueError, match="block"):
        decode_blocks(raw, "Q8_0", 48)
    with pytest.raises(ValueError, match="block"):
        decode_blocks(random_blocks("Q4_K", 1, 256, seed=0), "Q4_K", 128)
    with pytest.raises(ValueError, match="uint8"):
        decode_blocks(raw.view(np.int8), "Q8_0", 64)


@pytest.mark.parametrize("name", ["Q4_K", "Q6_K", "Q4_0"])
def test_check_decoded_catches_a_corrupted_scale(name):
    raw = random_blocks(name, ROWS, K, seed=7)
    reference = dequantize(raw, qtype(name))
    decoded = decode_blocks(raw, name, K)
    check_decoded(decoded, reference, "blk.0.attn_q.weight")  # the right scales pass
    decoded.scales[1, 3] += np.float32(1e-3) * np.abs(decoded.scales).max()
    with pytest.raises(ValueError, match=r"blk\.0\.attn_q\.weight.*row 1"):
        check_decoded(decoded, reference, "blk.0.attn_q.weight")


def test_check_decoded_catches_a_corrupted_min_and_a_shape_mismatch():
    raw = random_blocks("Q4_1", ROWS, K, seed=8)
    reference = dequantize(raw, qtype("Q4_1"))
    decoded = decode_blocks(raw, "Q4_1", K)
    check_decoded(decoded, reference, "token_embd.weight")
    with pytest.raises(ValueError, match="token_embd.weight"):
        check_decoded(decoded, reference[:2], "token_embd.weight")
    decoded.mins[2, 0] += np.float32(0.01)
    with pytest.raises(ValueError, match="token_embd.weight"):
        check_decoded(decoded, reference, "token_embd.weight")


@pytest.mark.parametrize("name", SUPPORTED)
def test_decoded_blocks_feed_the_quantized_weight_layout(name):
    """The loader's path: int4 codes nibble-packed, wrapped in a QuantizedWeight, whose reference
    dequantization reproduces gguf's."""
    raw = random_blocks(name, ROWS, K, seed=20 + SUPPORTED.index(name))
    d = decode_blocks(raw, name, K)
    codes = torch.from_numpy(d.codes)
    if d.kind in ("int4", "iq4"):
        codes = qweight.pack_int4(codes)
    qw = qweight.QuantizedWeight(d.kind, codes, torch.from_numpy(d.scales),
                                 None if d.mins is None else torch.from_numpy(d.mins), d.group_size, ROWS, K)
    reference = torch.from_numpy(dequantize(raw, qtype(name)))
    torch.testing.assert_close(qweight.dequantize(qw), reference, rtol=0,
                               atol=1e-6 * reference.abs().max().item())
