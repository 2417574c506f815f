"""Reference quantizers, written here from the GGUF block formats, for the types the `gguf` package
can dequantize but not quantize (Q2_K, Q3_K, IQ4_NL, IQ4_XS): simple round-to-nearest choices of
scales and codes, not llama.cpp's searches, good enough for a test checkpoint.

Each returns (blocks, values): the bytes to write into a file, and the float32 weights those bytes
stand for as this module meant them (its own dequantization of the scales and codes it chose), so a
test checks the packing against `gguf.quants.dequantize` of the same bytes.

Block layouts (ggml's block_* structs, f16 little-endian):
  Q2_K   256 weights, 84 bytes: scales[16] (scale | min << 4) | qs[64] | d | dmin
         w = d * scale_s * q - dmin * min_s, q in 0..3, sub-block s of 16 weights
  Q3_K   256 weights, 110 bytes: hmask[32] | qs[64] | scales[12] (6-bit, + 32) | d
         w = d * scale_s * q, q in -4..3 (low 2 bits in qs, +4 where its hmask bit is set)
  IQ4_NL 32 weights, 18 bytes: d | qs[16]; w = d * LEVELS[nibble]
  IQ4_XS 256 weights, 136 bytes: d | scales_h (u16) | scales_l[4] | qs[128] (16 per 32 sub-block);
         w = d * scale_j * LEVELS[nibble], scale_j 6-bit + 32
Low 2 bits of Q2_K/Q3_K: weight 32 a + l of each 128-weight half in bits 2a, 2a + 1 of byte l of its
32 bytes; Q3_K's hmask bit i of byte l belongs to weight 32 i + l. Nibbles of a 32-weight run:
byte j holds weight j (low) and weight 16 + j (high).
"""

from __future__ import annotations

import numpy as np

LEVELS = np.array([-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113], dtype=np.float32)
"""The 16 non-uniform levels of IQ4_NL and IQ4_XS, as the format defines them."""


def _f16(values: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(the f16 bytes (n, 2), the f16 values as float32 (n,))."""
    half = values.astype(np.float16)
    return half.view(np.uint8).reshape(-1, 2), half.astype(np.float32)


def _safe_inverse(x: np.ndarray) -> np.ndarray:
    return np.divide(1.0, x, out=np.zeros_like(x), where=x != 0)


def _two_bit_planes(q: np.ndarray) -> np.ndarray:
    """(n, 256) codes 0..3 -> (n, 64) bytes: weight 128 h + 32 a + l in bits 2a of byte 32 h + l."""
    n = q.shape[0]
    planes = q.reshape(n, 2, 4, 32).astype(np.uint8) << (2 * np.arange(4, dtype=np.uint8)).reshape(1, 1, 4, 1)
    return np.bitwise_or.reduce(planes, axis=2).reshape(n, 64)


def _nibble_runs(q: np.ndarray) -> np.ndarray:
    """(n, 32 m) codes 0..15 -> (n, 16 m) bytes, each 32-weight run as byte j = q[j] | q[16 + j] << 4."""
    n = q.shape[0]
    runs = q.reshape(n, -1, 2, 16).astype(np.uint8)
    return (runs[:, :, 0] | (runs[:, :, 1] << 4)).reshape(n, -1)


def _nearest_level(x: np.ndarray) -> np.ndarray:
    return np.abs(x[..., None] - LEVELS).argmin(-1).astype(np.uint8)


def quantize_q2_k(weight: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    rows, k = weight.shape
    x = weight.astype(np.float32).reshape(-1, 16, 16)  # (blocks, sub-block, weight)
    sub_min = np.maximum(-x.min(-1), 0)               # w >= -min
    sub_scale = (x.max(-1) + sub_min) / 3
    d_bytes, d = _f16(sub_scale.max(-1) / 15)
    m_bytes, dmin = _f16(sub_min.max(-1) / 15)
    sc = np.clip(np.rint(sub_scale * _safe_inverse(d)[:, None]), 0, 15)
    mn = np.clip(np.rint(sub_min * _safe_inverse(dmin)[:, None]), 0, 15)
    step = (d[:, None] * sc)[..., None]               # float32, as the format forms it
    offset = (dmin[:, None] * mn)[..., None]
    q = np.clip(np.rint((x + offset) * _safe_inverse(step)), 0, 3)
    values = step * q - offset
    scale_bytes = (sc.astype(np.uint8) | (mn.astype(np.uint8) << 4))
    blocks = np.concatenate([scale_bytes, _two_bit_planes(q.reshape(-1, 256)), d_bytes, m_bytes], axis=1)
    return blocks.reshape(rows, -1), values.reshape(rows, k).astype(np.float32)


def quantize_q3_k(weight: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    rows, k = weight.shape
    x = weight.astype(np.float32).reshape(-1, 16, 16)
    extreme = np.take_along_axis(x, np.abs(x).argmax(-1)[..., None], -1)[..., 0]
    sub_scale = extreme / -4                          # the largest weight maps to code -4
    d_bytes, d = _f16(np.abs(sub_scale).max(-1) / 31)
    sc = np.clip(np.rint(sub_scale * _safe_inverse(d)[:, None]), -32, 31)
    step = (d[:, None] * sc)[..., None]
    q = np.clip(np.rint(x * _safe_inverse(step)), -4, 3)
    values = step * q
    unsigned = (q + 4).astype(np.uint8).reshape(-1, 256)  # 0..7: bit 2 goes to hmask
    n = unsigned.shape[0]
    hmask = np.bitwise_or.reduce(
        (unsigned.reshape(n, 8, 32) >> 2) << np.arange(8, dtype=np.uint8).reshape(1, 8, 1), axis=1)
    stored = (sc + 32).astype(np.uint8)               # (n, 16), 0..63
    low = (stored[:, 0:8] & 0x0F) | ((stored[:, 8:16] & 0x0F) << 4)
    high_bits = (stored >> 4).reshape(n, 4, 4)        # [j // 4, j % 4]
    high = np.bitwise_or.reduce(high_bits << (2 * np.arange(4, dtype=np.uint8)).reshape(1, 4, 1), axis=1)
    blocks = np.concatenate([hmask, _two_bit_planes(unsigned & 3), low, high, d_bytes], axis=1)
    return blocks.reshape(rows, -1), values.reshape(rows, k).astype(np.float32)


def quantize_iq4_nl(weight: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    rows, k = weight.shape
    x = weight.astype(np.float32).reshape(-1, 32)
    extreme = np.take_along_axis(x, np.abs(x).argmax(-1)[:, None], -1)[:, 0]
    d_bytes, d = _f16(extreme / LEVELS[0])            # the largest weight on level -127
    q = _nearest_level(x * _safe_inverse(d)[:, None])
    values = d[:, None] * LEVELS[q]
    blocks = np.concatenate([d_bytes, _nibble_runs(q)], axis=1)
    return blocks.reshape(rows, -1), values.reshape(rows, k).astype(np.float32)


def quantize_iq4_xs(weight: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    rows, k = weight.shape
    x = weight.astype(np.float32).reshape(-1, 8, 32)
    extreme = np.take_along_axis(x, np.abs(x).argmax(-1)[..., None], -1)[..., 0]
    sub_scale = extreme / LEVELS[0]
    d_bytes, d = _f16(np.abs(sub_scale).max(-1) / 31)
    sc = np.clip(np.rint(sub_scale * _safe_inverse(d)[:, None]), -32, 31)
    step = d[:, None] * sc                            # float32, as the format forms it
    q = _nearest_level(x * _safe_inverse(step)[..., None])
    values = step[..., None] * LEVELS[q]
    stored = (sc + 32).astype(np.uint8)               # (n, 8), 0..63
    n = stored.shape[0]
    scales_h = np.bitwise_or.reduce((stored >> 4).astype(np.uint16) << (2 * np.arange(8, dtype=np.uint16)), axis=1)
    scales_l = (stored[:, 0::2] & 0x0F) | ((stored[:, 1::2] & 0x0F) << 4)
    blocks = np.concatenate([d_bytes, scales_h.astype("<u2").view(np.uint8).reshape(n, 2), scales_l,
                             _nibble_runs(q.reshape(n, 256))], axis=1)
    return blocks.reshape(rows, -1), values.reshape(rows, k).astype(np.float32)


REFERENCE_QUANTIZERS = {"Q2_K": quantize_q2_k, "Q3_K": quantize_q3_k, "IQ4_NL": quantize_iq4_nl,
                        "IQ4_XS": quantize_iq4_xs}
"""GGUF type -> quantizer, for the types gguf.quants.quantize cannot make."""
