"""GGUF (llama.cpp) quantized blocks -> integer codes plus per-group scales and mins.

A GGUF checkpoint already holds its weights quantized. Dequantizing them to floats at load (what
`gguf.quants.dequantize` does) would throw that away and cost 4-8x the memory; instead this module
reads each ggml block format into the engine's own layout (see `qweight.py`):

    w[n, k] = scales[n, k // group_size] * code[n, k] + mins[n, k // group_size]

keeping the codes as integers (for IQ4_NL/IQ4_XS, the iq4 kind, code[n, k] stands for the level
its nibble indexes). Every decoder works on all blocks of a tensor at once with numpy
(a tensor has millions of weights; a Python loop per block would take minutes to load a model).

The byte layouts follow ggml's `block_*` structs (ggml-common.h) and its reference dequantizers
(`dequantize_row_*` in ggml-quants.c). Per-group scales are formed exactly as ggml forms them
(a float32 product of the f16 super-scale and the integer sub-scale) so that scale * code + min
reproduces ggml's floats up to float32 rounding; `check_decoded` verifies that at load.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from kvtide.layers.quantization.qweight import IQ4_LEVELS

SUPPORTED = ("Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K", "IQ4_NL", "IQ4_XS")

# (weights per block, bytes per block), as in ggml's GGML_QUANT_SIZES.
_BLOCK = {
    "Q8_0": (32, 34),    # f16 d | int8 q[32]
    "Q4_0": (32, 18),    # f16 d | u8 qs[16]
    "Q4_1": (32, 20),    # f16 d | f16 m | u8 qs[16]
    "Q5_0": (32, 22),    # f16 d | u8 qh[4] | u8 qs[16]
    "Q5_1": (32, 24),    # f16 d | f16 m | u8 qh[4] | u8 qs[16]
    "Q2_K": (256, 84),   # u8 scales[16] | u8 qs[64] | f16 d | f16 dmin
    "Q3_K": (256, 110),  # u8 hmask[32] | u8 qs[64] | u8 scales[12] | f16 d
    "Q4_K": (256, 144),  # f16 d | f16 dmin | u8 scales[12] | u8 qs[128]
    "Q5_K": (256, 176),  # f16 d | f16 dmin | u8 scales[12] | u8 qh[32] | u8 qs[128]
    "Q6_K": (256, 210),  # u8 ql[128] | u8 qh[64] | int8 scales[16] | f16 d
    "IQ4_NL": (32, 18),  # f16 d | u8 qs[16]
    "IQ4_XS": (256, 136),  # f16 d | u16 scales_h | u8 scales_l[4] | u8 qs[128]
}

IQ4_VALUES = IQ4_LEVELS.numpy()
"""The 16 levels an IQ4_NL / IQ4_XS nibble indexes: the nibbles are kept as they are (the iq4 kind),
the kernels look the levels up."""


@dataclass
class DecodedBlocks:
    """One tensor's blocks as integer codes and float32 per-group numbers (the qweight layout,
    except that int4 codes are one per byte, not nibble-packed)."""
    kind: str                # "int4" (uint8 codes 0..15), "iq4" (uint8 level indices 0..15) or "int8"
    codes: np.ndarray        # (rows, k)
    scales: np.ndarray       # (rows, k // group_size) float32
    mins: np.ndarray | None  # (rows, k // group_size) float32, None for symmetric types
    group_size: int

    def values(self, start: int = 0, end: int | None = None) -> np.ndarray:
        """Rows [start, end) as float32: scales * codes + mins."""
        codes = self.codes[start:end]
        if self.kind == "iq4":
            codes = IQ4_VALUES[codes]
        rows, k = codes.shape
        g = self.group_size
        out = codes.reshape(rows, k // g, g).astype(np.float32)
        out *= self.scales[start:end, :, None]
        if self.mins is not None:
            out += self.mins[start:end, :, None]
        return out.reshape(rows, k)


def _f16(blocks: np.ndarray, offset: int) -> np.ndarray:
    """The f16 at byte `offset` of every block, as float32 (n_blocks,)."""
    return np.ascontiguousarray(blocks[:, offset:offset + 2]).view(np.float16)[:, 0].astype(np.float32)


def _nibbles_32(qs: np.ndarray) -> np.ndarray:
    """(n, 16 * m) bytes -> (n, 32 * m) codes: each run of 16 bytes carries 32 weights, the low
    nibbles first (weights 0..15), then the high nibbles (weights 16..31): the Q4_0/Q4_1 order,
    one run per block. The K-quants use the same scheme with 32-byte runs (_nibbles_64)."""
    n = qs.shape[0]
    runs = qs.reshape(n, -1, 16)
    out = np.empty((n, runs.shape[1], 2, 16), dtype=np.uint8)
    np.bitwise_and(runs, 0x0F, out=out[:, :, 0])
    np.right_shift(runs, 4, out=out[:, :, 1])
    return out.reshape(n, -1)


def _nibbles_64(qs: np.ndarray) -> np.ndarray:
    """K-quant nibbles: each 32-byte run holds two 32-weight sub-blocks, the first in the low
    nibbles of the 32 bytes and the second in the high nibbles. (n, 128) -> (n, 8, 32)."""
    n = qs.shape[0]
    runs = qs.reshape(n, 4, 32)
    out = np.empty((n, 4, 2, 32), dtype=np.uint8)
    np.bitwise_and(runs, 0x0F, out=out[:, :, 0])
    np.right_shift(runs, 4, out=out[:, :, 1])
    return out.reshape(n, 8, 32)


def _k_scales_mins(packed: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The 12 bytes of Q4_K/Q5_K sub-block scales: eight 6-bit scales and eight 6-bit mins.
    Bytes 0..3 hold scales 0..3 and bytes 4..7 mins 0..3 in their low 6 bits; sub-blocks 4..7
    take their low 4 bits from bytes 8..11 (scale in the low nibble, min in the high) and their
    top 2 bits from the top 2 bits of bytes 0..3 (scales) and 4..7 (mins). -> two (n, 8) uint8."""
    lo, hi, ext = packed[:, 0:4], packed[:, 4:8], packed[:, 8:12]
    sc = np.concatenate([lo & 0x3F, (ext & 0x0F) | ((lo >> 6) << 4)], axis=1)
    mn = np.concatenate([hi & 0x3F, (ext >> 4) | ((hi >> 6) << 4)], axis=1)
    return sc, mn


def _decode_q8_0(b: np.ndarray):
    codes = np.ascontiguousarray(b[:, 2:]).view(np.int8)
    return "int8", codes, _f16(b, 0)[:, None], None, 32


def _decode_q4_0(b: np.ndarray):
    d = _f16(b, 0)[:, None]
    # w = d * (q - 8) = d * q + (-8 d); both forms are exact in float32 (f16 d times a 4-bit integer).
    return "int4", _nibbles_32(b[:, 2:]), d, d * np.float32(-8.0), 32


def _decode_q4_1(b: np.ndarray):
    return "int4", _nibbles_32(b[:, 4:]), _f16(b, 0)[:, None], _f16(b, 2)[:, None], 32


def _fifth_bits(qh: np.ndarray) -> np.ndarray:
    """Q5_0/Q5_1's 32 high bits (a little-endian u32, bit j for weight j): (n, 4) bytes -> (n, 32) 0/1."""
    return np.unpackbits(np.ascontiguousarray(qh), axis=1, bitorder="little")


def _decode_q5_0(b: np.ndarray):
    # w = d * (q - 16): the centred codes -16..15 are int8 and need no min (exact in float32).
    q = _nibbles_32(b[:, 6:22]) | (_fifth_bits(b[:, 2:6]) << 4)
    return "int8", q.view(np.int8) - np.int8(16), _f16(b, 0)[:, None], None, 32


def _decode_q5_1(b: np.ndarray):
    q = _nibbles_32(b[:, 8:24]) | (_fifth_bits(b[:, 4:8]) << 4)
    return "int8", q.view(np.int8), _f16(b, 0)[:, None], _f16(b, 2)[:, None], 32


def _two_bit_planes(qs: np.ndarray) -> np.ndarray:
    """Q2_K/Q3_K low bits: each 128-weight half reads 32 bytes four times, bit pair a (bits 2a,
    2a+1) of byte l being weight 32 * a + l of the half. (n, 64) -> (n, 256) codes 0..3."""
    n = qs.shape[0]
    shifts = np.array([0, 2, 4, 6], dtype=np.uint8).reshape(1, 1, 4, 1)
    return ((qs.reshape(n, 2, 1, 32) >> shifts) & 3).reshape(n, 256)


def _decode_q2_k(b: np.ndarray):
    # Sixteen 16-weight sub-blocks: w = (d * sc) * q - (dmin * m), sc and m the low and high nibble
    # of the sub-block's scale byte; formed in float32 as ggml does.
    sc = b[:, 0:16]
    scales = _f16(b, 80)[:, None] * (sc & 0x0F).astype(np.float32)
    mins = -(_f16(b, 82)[:, None] * (sc >> 4).astype(np.float32))
    return "int4", _two_bit_planes(b[:, 16:80]), scales, mins, 16


def _q3_k_scales(packed: np.ndarray) -> np.ndarray:
    """Q3_K's sixteen 6-bit scales (stored + 32): low nibbles in bytes 0..7 (sub-blocks 0..7 in the
    low nibbles, 8..15 in the high ones), top 2 bits of sub-block j in bits 2 (j // 4), +1 of
    byte 8 + j % 4. -> (n, 16) int8, -32..31."""
    low = np.concatenate([packed[:, 0:8] & 0x0F, packed[:, 0:8] >> 4], axis=1)
    shifts = np.array([0, 2, 4, 6], dtype=np.uint8).reshape(1, 4, 1)
    high = ((packed[:, None, 8:12] >> shifts) & 3).reshape(-1, 16)
    return (low | (high << 4)).view(np.int8) - np.int8(32)


def _decode_q3_k(b: np.ndarray):
    # w = (d * sc) * q with q = (low two bits) - 4 where the weight's hmask bit is clear: -4..3,
    # kept as the unsigned code q + 4 (the low bits plus 4 times the hmask bit, 0..7) and a min of
    # -4 (d * sc): s * (q + 4) - 4 s rounds to the same float32 as ggml's s * q in one FMA.
    # Bit i of hmask[l] belongs to weight 32 * i + l.
    n = b.shape[0]
    hbit = (b[:, None, 0:32] >> np.arange(8, dtype=np.uint8).reshape(1, 8, 1)) & 1
    codes = _two_bit_planes(b[:, 32:96]) | (hbit.reshape(n, 256) << 2)
    scales = _f16(b, 108)[:, None] * _q3_k_scales(b[:, 96:108]).astype(np.float32)
    return "int4", codes, scales, scales * np.float32(-4.0), 16


def _decode_iq4_nl(b: np.ndarray):
    return "iq4", _nibbles_32(b[:, 2:18]), _f16(b, 0)[:, None], None, 32


def _decode_iq4_xs(b: np.ndarray):
    # Eight 32-weight sub-blocks, each with a 6-bit scale (stored + 32): low 4 bits in the nibbles of
    # scales_l (sub-block j: byte j // 2, low nibble for even j), top 2 bits in bits 2j, 2j+1 of
    # scales_h. w = (d * scale) * level[q]; a sub-block's 16 bytes hold its nibbles as Q4_0's do.
    n = b.shape[0]
    scales_l = b[:, 4:8]
    low = np.stack([scales_l & 0x0F, scales_l >> 4], axis=2).reshape(n, 8)
    scales_h = np.ascontiguousarray(b[:, 2:4]).view(np.uint16)  # (n, 1)
    high = ((scales_h >> (2 * np.arange(8, dtype=np.uint16))) & 3).astype(np.uint8)
    sub = (low | (high << 4)).view(np.int8) - np.int8(32)
    scales = _f16(b, 0)[:, None] * sub.astype(np.float32)
    return "iq4", _nibbles_32(b[:, 8:136]), scales, None, 32


def _k_groups(b: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K/Q5_K per-sub-block (scale, min): d * sc_j and -(dmin * m_j), in float32 as ggml does."""
    sc, mn = _k_scales_mins(b[:, 4:16])
    scales = _f16(b, 0)[:, None] * sc.astype(np.float32)
    mins = -(_f16(b, 2)[:, None] * mn.astype(np.float32))
    return scales, mins


def _decode_q4_k(b: np.ndarray):
    scales, mins = _k_groups(b)
    return "int4", _nibbles_64(b[:, 16:144]), scales, mins, 32


def _decode_q5_k(b: np.ndarray):
    scales, mins = _k_groups(b)
    low = _nibbles_64(b[:, 48:176])  # (n, 8, 32)
    # Bit j of qh[l] is the fifth bit of weight l of sub-block j.
    qh = b[:, 16:48]
    high = (qh[:, None, :] >> np.arange(8, dtype=np.uint8)[None, :, None]) & 1
    codes = (low | (high << 4)).view(np.int8)  # 0..31 fits int8
    return "int8", codes, scales, mins, 32


def _decode_q6_k(b: np.ndarray):
    n = b.shape[0]
    # Each 128-weight half uses 64 bytes of ql and 32 of qh. Within a half, weight 32 * a + l
    # (a < 4, l < 32) has its low 4 bits in ql[l + 32 * (a % 2)] (low nibble for a < 2, high for
    # a >= 2) and its top 2 bits in bits 2a, 2a+1 of qh[l].
    ql = b[:, 0:128].reshape(n, 2, 1, 2, 32)                         # (half, -, a % 2, l)
    low = (ql >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2, 1, 1)) & 0x0F  # (half, a // 2, a % 2, l)
    qh = b[:, 128:192].reshape(n, 2, 1, 32)
    high = (qh >> np.array([0, 2, 4, 6], dtype=np.uint8).reshape(1, 1, 4, 1)) & 0x03  # (half, a, l)
    q = low.reshape(n, 2, 4, 32) | (high << 4)                        # 0..63
    codes = (q.view(np.int8) - np.int8(32)).reshape(n, 256)
    # Sub-block s (16 weights, in order) uses the int8 scale s: d * sc_s, in float32.
    sub = np.ascontiguousarray(b[:, 192:208]).view(np.int8).astype(np.float32)
    return "int8", codes, _f16(b, 208)[:, None] * sub, None, 16


_DECODERS = {"Q8_0": _decode_q8_0, "Q4_0": _decode_q4_0, "Q4_1": _decode_q4_1, "Q5_0": _decode_q5_0,
             "Q5_1": _decode_q5_1, "Q2_K": _decode_q2_k, "Q3_K": _decode_q3_k, "Q4_K": _decode_q4_k,
             "Q5_K": _decode_q5_k, "Q6_K": _decode_q6_k, "IQ4_NL": _decode_iq4_nl, "IQ4_XS": _decode_iq4_xs}


def decode_blocks(raw: np.ndarray, type_name: str, k: int) -> DecodedBlocks:
    """Decode a GGUF tensor's raw bytes into codes, scales and mins without dequantizing.

    raw: uint8 (rows, bytes_per_row), exactly as the data lies in the file (rows = product of all
    dims but the innermost; leading dims beyond one are flattened, a 1-D array is one row);
    k: the innermost dim, the number of weights per row."""
    if type_name not in _BLOCK:
        raise ValueError(f"GGUF type {type_name!r} cannot be kept quantized; supported: {', '.join(SUPPORTED)}")
    block, type_size = _BLOCK[type_name]
    raw = np.asarray(raw)
    if raw.dtype != np.uint8:
        raise ValueError(f"raw GGUF data must be uint8 bytes; got {raw.dtype}")
    if raw.ndim == 0:
        raise ValueError("raw GGUF data must have at least one dimension")
    if k <= 0 or k % block:
        raise ValueError(f"{type_name} packs {block} weights per block; a row of {k} weights is not a "
                         f"whole number of blocks")
    row_bytes = k // block * type_size
    if raw.shape[-1] != row_bytes:
        raise ValueError(f"{type_name} rows of {k} weights take {row_bytes} bytes; got {raw.shape[-1]}")
    rows = raw.reshape(-1, row_bytes)
    n_rows = rows.shape[0]
    blocks = np.ascontiguousarray(rows).reshape(-1, type_size)
    kind, codes, scales, mins, group = _DECODERS[type_name](blocks)
    return DecodedBlocks(
        kind=kind,
        codes=np.ascontiguousarray(codes).reshape(n_rows, k),
        scales=np.ascontiguousarray(scales, dtype=np.float32).reshape(n_rows, k // group),
        mins=None if mins is None else np.ascontiguousarray(mins, dtype=np.float32).reshape(n_rows, k // group),
        group_size=group,
    )


# The decoded values differ from ggml's (and gguf's numpy) dequantization only in how the same
# float32 operations are associated (e.g. d * q + (-8 d) against d * (q - 8)): each value is off by
# at most a couple of float32 roundings of terms the size of the weights, ~2 * 2**-24 * max|w| ≈
# 1.2e-7 * max|w|. 1e-6 relative (about 8 ulps) leaves margin for that while any real decoding
# error (a wrong nibble order, a swapped scale) moves values by a whole quantization step, orders
# of magnitude more. 1e-7 absolute keeps an all-zero or near-zero tensor from failing on rounding.
_CHECK_RTOL = 1e-6
_CHECK_ATOL = 1e-7
_CHECK_CHUNK = 1 << 22  # weights per chunk, so the check never holds a full float32 copy


def check_decoded(decoded: DecodedBlocks, reference: np.ndarray, name: str) -> None:
    """Raise ValueError naming tensor `name` if scales * codes + mins differs from `reference` (the
    float32 dequantization of the same bytes, e.g. by gguf.quants.dequantize) beyond float32 rounding."""
    rows, k = decoded.codes.shape
    reference = np.asarray(reference)
    if reference.size != rows * k:
        raise ValueError(f"{name}: decoded {rows}x{k} weights but the reference has shape {reference.shape}")
    reference = reference.reshape(rows, k)
    peak = float(np.max(np.abs(reference))) if reference.size else 0.0
    if not np.isfinite(peak):
        raise ValueError(f"{name}: the reference dequantization has non-finite values")
    tol = _CHECK_RTOL * peak + _CHECK_ATOL
    step = max(1, _CHECK_CHUNK // k)
    for start in range(0, rows, step):
        end = min(rows, start + step)
        err = np.abs(decoded.values(start, end) - reference[start:end])
        bad = ~(err <= tol)  # NaN counts as bad
        if bad.any():
            r, c = np.unravel_index(int(np.argmax(bad)), bad.shape)
            raise ValueError(f"{name}: decoded GGUF blocks differ from the dequantized reference by up to "
                             f"{float(np.max(err)):.3g} (tolerance {tol:.3g}); first at row {start + r}, "
                             f"column {c}")
