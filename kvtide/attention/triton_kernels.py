"""Triton kernels over the paged KV cache: writing new K/V at the slot mapping, and one attention
kernel for a whole packed batch (decodes and prefill chunks over a cached prefix alike), over a
float cache or the quantized byte layout of kv_compression/formats.py.

Work split of the attention kernel. The grid is (num_q_blocks, num_kv_heads). A program takes up
to BLOCK_Q query tokens of one request and, for one KV head, every query head that shares it
(GQA), so each K/V tile it loads serves BLOCK_Q * queries_per_kv rows of the score matrix:

    tile rows (BLOCK_M = BLOCK_Q * HEADS_PADDED):  row r -> token r // HEADS_PADDED of the block,
                                                          query head kv_head * qpk + r % HEADS_PADDED
    request i owns q blocks  [query_start_loc[i] // BLOCK_Q + i, query_start_loc[i+1] // BLOCK_Q + i + 1)
                             (at least ceil(q_len / BLOCK_Q) of them; spare ones exit at once)

So num_q_blocks = num_tokens // BLOCK_Q + num_reqs depends only on host-known sizes, never on
device values: no sync, and a decode batch has a fixed grid (CUDA graphs). A program finds its
request by binary search over query_start_loc.

Keys are gathered per position through the block table, so any KV block size works with any key
tile (TILE_N). Key j of request i, block b = block_tables[i, j // block_size], slot s = j % block_size:

    float cache  (2, num_blocks, block_size, H_kv, D)   K at [0, b, s, h, :], V at [1, b, s, h, :]
    quantized    (H_kv, num_blocks, block_bytes) uint8  K codes at [h, b, s * D:], V codes at
                 [h, b, v_codes + s * v_width:], per-token params at [h, b, k/v_params + s * 2 (int4: 4):]

which the kernel addresses alike: (block, head) base + section offset + slot * slot stride.

Query token t of a chunk of q_len tokens over seq_len context tokens sits at position
seq_len - q_len + t and sees key j iff  j <= position  and, with a window W, j > position - W or
j < sink_tokens. With a window the key loop starts at the window of the block's first query, after
first visiting the sinks it would skip. A logits soft cap c (Gemma 2) bends each scaled score s to
c * tanh(s / c) before the mask, in float32 like the rest of the softmax.

The dot runs in the query's dtype whatever the cache holds: a float cache of another dtype is
converted per tile; quantized codes become small exact values (int8 codes and fp8 values are exact
in float16, bfloat16 and float32) and their scales are applied around the dot, which is the same
dequantization, reassociated: per-key K scales multiply the score columns, per-key V scales (and
int4's scale) multiply P's columns, int4's per-key min adds sum_j p_j * min_j to every output dim,
fp8's per-tensor V scale multiplies the output once. Scores and the online softmax are float32.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from kvtide.kv_compression.formats import KIND_IDS, KVQuantFormat

LOG2E = math.log2(math.e)

FLOAT_KIND = -1
"""The kernels' K/V kind for a float cache; the quantized kinds are formats.KIND_IDS."""
_FLOAT: tl.constexpr = tl.constexpr(FLOAT_KIND)
_E4M3: tl.constexpr = tl.constexpr(KIND_IDS["fp8_e4m3"])
_E5M2: tl.constexpr = tl.constexpr(KIND_IDS["fp8_e5m2"])
_INT8: tl.constexpr = tl.constexpr(KIND_IDS["int8"])
_INT4: tl.constexpr = tl.constexpr(KIND_IDS["int4"])
_E4M3_AS_F16: tl.constexpr = tl.constexpr(256.0)
"""An e4m3 byte moved into a float16's bits reads 1/256 of its value (exponent bias 15 vs 7)."""


def kind_ids(kv_quant: KVQuantFormat | None) -> tuple[int, int]:
    """(K kind, V kind) as the kernels take them."""
    if kv_quant is None:
        return FLOAT_KIND, FLOAT_KIND
    return KIND_IDS[kv_quant.k_kind], KIND_IDS[kv_quant.v_kind]


# ---- codec helpers --------------------------------------------------------------------------------
@triton.jit
def _round_half_even(x):
    """float32 to the nearest integer, ties to even (torch.round), for |x| < 2**22: with 1.5 * 2**23
    added no fraction bits are left, so the addition itself rounds (the interpreter has no rint)."""
    return (x + 12582912.0) - 12582912.0


@triton.jit
def _load_f16(ptr, mask):
    """A float16 kept as two little-endian bytes, at any alignment -> float32 (0 where masked)."""
    lo = tl.load(ptr, mask=mask, other=0).to(tl.uint16)
    hi = tl.load(ptr + 1, mask=mask, other=0).to(tl.uint16)
    return (lo | (hi << 8)).to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def _store_f16(ptr, x, mask):
    """float32 x, exactly a float16 value, as two little-endian bytes (a token's params need not be
    2-byte aligned: block_bytes can be odd)."""
    bits = x.to(tl.float16).to(tl.uint16, bitcast=True)
    tl.store(ptr, (bits & 0xFF).to(tl.uint8), mask=mask)
    tl.store(ptr + 1, (bits >> 8).to(tl.uint8), mask=mask)


@triton.jit
def _fp8_bits(y, MANT: tl.constexpr, BIAS: tl.constexpr):
    """float32 y within the format's finite range -> its fp8 byte, rounded to nearest even as torch's
    .to(float8_*) rounds. Done on the bits: the interpreter's fp8 casts lose the carry into the
    exponent (1.97 -> 1.0), and sm_80 has no e4m3 conversion at all."""
    bits = y.to(tl.int32, bitcast=True)
    sign = (bits >> 24) & 0x80
    mag = bits & 0x7FFFFFFF
    SHIFT: tl.constexpr = 23 - MANT
    # normal: round the float32 mantissa to MANT bits (a carry moves into the exponent), rebias
    normal = ((mag + ((1 << (SHIFT - 1)) - 1) + ((mag >> SHIFT) & 1)) >> SHIFT) - ((127 - BIAS) << MANT)
    # below the smallest normal 2**(1 - BIAS): integer multiples of 2**(1 - BIAS - MANT) (the
    # minimum keeps the unused lanes' integer conversion in range)
    tiny = _round_half_even(tl.minimum(tl.abs(y), 1.0) * (1 << (BIAS - 1 + MANT))).to(tl.int32)
    return (tl.where(mag < ((128 - BIAS) << 23), tiny, normal) | sign).to(tl.uint8)


@triton.jit
def _fp8_as_f16(codes, KIND: tl.constexpr):
    """fp8 bytes -> float16, exact for every finite code, by moving bits (no fp8 instructions, so
    also sm_80 and the interpreter): e5m2 is a float16's high byte; e4m3 lands on the float16 of
    1/256 its value (_E4M3_AS_F16), a factor the callers fold into the tensor scale."""
    c = codes.to(tl.uint16)
    if KIND == _E5M2:
        bits = c << 8
    else:
        bits = ((c & 0x80) << 8) | ((c & 0x7F) << 7)
    return bits.to(tl.float16, bitcast=True)


@triton.jit
def _quantize_store(x, codes_ptrs, params_ptrs, mask, row_mask, kv_scale_ptr, WHICH: tl.constexpr,
                    KIND: tl.constexpr):
    """float32 rows x (BLOCK_H, BLOCK_D), one per head, coded as formats.quantize codes them (fp8
    divided by kv_scale[WHICH], int8); masked lanes hold 0. IEEE division (div_rn) as torch
    divides: the bytes must be equal."""
    if KIND == _INT8:
        scale = tl.math.div_rn(tl.max(tl.abs(x), 1), 127.0).to(tl.float16).to(tl.float32)
        scale = tl.where(scale > 0.0, scale, 1.0)
        codes = _round_half_even(tl.math.div_rn(x, scale[:, None]))
        codes = tl.minimum(tl.maximum(codes, -127.0), 127.0).to(tl.int8).to(tl.uint8, bitcast=True)
        _store_f16(params_ptrs, scale, row_mask)
    elif KIND == _E4M3:
        y = tl.math.div_rn(x, tl.load(kv_scale_ptr + WHICH))
        codes = _fp8_bits(tl.minimum(tl.maximum(y, -448.0), 448.0), 3, 7)
    else:
        y = tl.math.div_rn(x, tl.load(kv_scale_ptr + WHICH))
        codes = _fp8_bits(tl.minimum(tl.maximum(y, -57344.0), 57344.0), 2, 15)
    tl.store(codes_ptrs, codes, mask=mask)


@triton.jit
def _int4_codes(x, lo, step):
    """(x - min) / step rounded to 0..15, per row."""
    return tl.minimum(tl.maximum(_round_half_even(tl.math.div_rn(x - lo[:, None], step[:, None])), 0.0),
                      15.0).to(tl.uint8)


@triton.jit
def _quantize_store_int4(x_lo, x_hi, dim_valid, codes_ptrs, params_ptrs, mask, row_mask):
    """Rows split in halves (dims [0, D/2) and [D/2, D)) coded as formats.quantize codes int4: one
    byte per dim pair, the low half in the low nibble; params (step, min) as float16."""
    inf = float("inf")
    x_min = tl.minimum(tl.min(tl.where(dim_valid, x_lo, inf), 1), tl.min(tl.where(dim_valid, x_hi, inf), 1))
    x_max = tl.maximum(tl.max(tl.where(dim_valid, x_lo, -inf), 1), tl.max(tl.where(dim_valid, x_hi, -inf), 1))
    lo = x_min.to(tl.float16).to(tl.float32)
    step = tl.math.div_rn(x_max - lo, 15.0).to(tl.float16).to(tl.float32)
    step = tl.where(step > 0.0, step, 1.0)
    tl.store(codes_ptrs, _int4_codes(x_lo, lo, step) | (_int4_codes(x_hi, lo, step) << 4), mask=mask)
    _store_f16(params_ptrs, step, row_mask)
    _store_f16(params_ptrs + 2, lo, row_mask)


@triton.jit
def _int_codes_as(codes, DOT_DTYPE: tl.constexpr):
    """Small integer codes as floats of the dot's dtype, through float32 (exact): the interpreter
    would turn ints into bf16 by their bit patterns."""
    return codes.to(tl.float32).to(DOT_DTYPE)


@triton.jit
def _load_kv_tile(ptrs, mask, KIND: tl.constexpr, DOT_DTYPE: tl.constexpr):
    """A K or V tile in the dot's dtype: floats converted, int8 codes and fp8 values (both exact in
    any float dtype) with their scales left to the caller."""
    if KIND == _FLOAT:
        tile = tl.load(ptrs, mask=mask, other=0.0).to(DOT_DTYPE)
    elif KIND == _INT8:
        tile = _int_codes_as(tl.load(ptrs, mask=mask, other=0).to(tl.int8, bitcast=True), DOT_DTYPE)
    else:
        tile = _fp8_as_f16(tl.load(ptrs, mask=mask, other=0), KIND).to(DOT_DTYPE)
    return tile


# ---- writing K/V --------------------------------------------------------------------------------
@triton.jit
def _to_cache_dtype(x, DTYPE: tl.constexpr):
    """x converted to the float cache's dtype, rounded to nearest even as torch's .to() rounds;
    to bfloat16 on the bits, since the interpreter truncates (compiled Triton rounds alike)."""
    if DTYPE == tl.bfloat16 and x.dtype != tl.bfloat16:
        bits = x.to(tl.float32).to(tl.int32, bitcast=True)
        rounded = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).to(tl.int16).to(tl.bfloat16, bitcast=True)
        converted = tl.where(x == x, rounded, x.to(tl.bfloat16))  # NaN stays NaN
    else:
        converted = x.to(DTYPE)
    return converted


@triton.jit
def _write_kv_kernel(key_ptr, value_ptr, cache_ptr, slot_mapping_ptr,
                     key_stride_t, key_stride_h, value_stride_t, value_stride_h,
                     cache_stride_kv, cache_stride_block, cache_stride_slot, cache_stride_h,
                     num_kv_heads, head_dim, block_size,
                     BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr):
    """Float cache: rows copied, converted to the cache's dtype."""
    token = tl.program_id(0)
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    heads = tl.arange(0, BLOCK_H)
    dims = tl.arange(0, BLOCK_D)
    # A negative slot is a padding token (CUDA-graph buckets): no head is written.
    heads_to_write = tl.where(slot >= 0, num_kv_heads, 0)
    mask = (heads[:, None] < heads_to_write) & (dims[None, :] < head_dim)
    dst = (cache_ptr + (slot // block_size) * cache_stride_block + (slot % block_size) * cache_stride_slot
           + heads[:, None] * cache_stride_h + dims[None, :])
    cache_dtype = cache_ptr.dtype.element_ty
    key = tl.load(key_ptr + token * key_stride_t + heads[:, None] * key_stride_h + dims[None, :], mask=mask)
    tl.store(dst, _to_cache_dtype(key, cache_dtype), mask=mask)
    value = tl.load(value_ptr + token * value_stride_t + heads[:, None] * value_stride_h + dims[None, :],
                    mask=mask)
    tl.store(dst + cache_stride_kv, _to_cache_dtype(value, cache_dtype), mask=mask)


@triton.jit
def _write_kv_quant_kernel(key_ptr, value_ptr, cache_ptr, slot_mapping_ptr, kv_scale_ptr,
                           key_stride_t, key_stride_h, value_stride_t, value_stride_h,
                           cache_stride_h, cache_stride_block, v_codes_offset, k_params_offset,
                           v_params_offset, num_kv_heads, head_dim, block_size,
                           K_KIND: tl.constexpr, V_KIND: tl.constexpr, BLOCK_H: tl.constexpr,
                           BLOCK_D: tl.constexpr):
    """Quantized cache: one token per program, every KV head's K and V row coded into its block."""
    token = tl.program_id(0)
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    heads = tl.arange(0, BLOCK_H)
    head_valid = heads < tl.where(slot >= 0, num_kv_heads, 0)  # a negative slot (padding) writes nothing
    offset = slot % block_size
    base = cache_ptr + heads.to(tl.int64) * cache_stride_h + (slot // block_size) * cache_stride_block
    dims = tl.arange(0, BLOCK_D)
    mask = head_valid[:, None] & (dims[None, :] < head_dim)
    key = tl.load(key_ptr + token * key_stride_t + heads[:, None] * key_stride_h + dims[None, :], mask=mask,
                  other=0.0).to(tl.float32)
    _quantize_store(key, base[:, None] + offset * head_dim + dims[None, :],
                    base + k_params_offset + offset * 2, mask, head_valid, kv_scale_ptr, 0, K_KIND)
    value_rows = value_ptr + token * value_stride_t + heads[:, None] * value_stride_h
    if V_KIND == _INT4:
        HALF: tl.constexpr = BLOCK_D // 2
        half = head_dim // 2
        half_dims = tl.arange(0, HALF)
        half_valid = half_dims[None, :] < half
        half_mask = head_valid[:, None] & half_valid
        v_lo = tl.load(value_rows + half_dims[None, :], mask=half_mask, other=0.0).to(tl.float32)
        v_hi = tl.load(value_rows + half + half_dims[None, :], mask=half_mask, other=0.0).to(tl.float32)
        _quantize_store_int4(v_lo, v_hi, half_valid,
                             base[:, None] + v_codes_offset + offset * half + half_dims[None, :],
                             base + v_params_offset + offset * 4, half_mask, head_valid)
    else:
        value = tl.load(value_rows + dims[None, :], mask=mask, other=0.0).to(tl.float32)
        _quantize_store(value, base[:, None] + v_codes_offset + offset * head_dim + dims[None, :],
                        base + v_params_offset + offset * 2, mask, head_valid, kv_scale_ptr, 1, V_KIND)


def write_kv_cache(key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor,
                   kv_quant: KVQuantFormat | None = None, kv_scale: torch.Tensor | None = None) -> None:
    """key, value (num_tokens, num_kv_heads, head_dim) into kv_cache at slot_mapping (num_tokens,);
    slot -1 skips. kv_cache is (2, num_blocks, block_size, num_kv_heads, head_dim) of any float
    dtype, or with kv_quant the (num_kv_heads, num_blocks, block_bytes) uint8 layout, coded exactly
    as KVQuantFormat.write codes it (fp8 kinds divide by kv_scale, (2,) float32 on the device)."""
    num_tokens = slot_mapping.shape[0]
    if num_tokens == 0:
        return
    assert key.stride(-1) == 1 and value.stride(-1) == 1 and kv_cache.stride(-1) == 1
    head_dim = key.shape[-1]
    if kv_quant is None:
        _, _, block_size, num_kv_heads, cache_head_dim = kv_cache.shape
        assert key.shape[0] >= num_tokens and key.shape[1:] == (num_kv_heads, cache_head_dim), key.shape
        _write_kv_kernel[(num_tokens,)](
            key, value, kv_cache, slot_mapping,
            key.stride(0), key.stride(1), value.stride(0), value.stride(1),
            kv_cache.stride(0), kv_cache.stride(1), kv_cache.stride(2), kv_cache.stride(3),
            num_kv_heads, head_dim, block_size,
            BLOCK_H=triton.next_power_of_2(num_kv_heads), BLOCK_D=triton.next_power_of_2(head_dim))
        return
    num_kv_heads = kv_cache.shape[0]
    block_size, lay = _quant_layout(kv_cache, kv_quant, head_dim, kv_scale)
    assert key.shape[0] >= num_tokens and key.shape[1] == num_kv_heads, key.shape
    k_kind, v_kind = kind_ids(kv_quant)
    _write_kv_quant_kernel[(num_tokens,)](
        key, value, kv_cache, slot_mapping, kv_scale if kv_quant.uses_tensor_scales else None,
        key.stride(0), key.stride(1), value.stride(0), value.stride(1),
        kv_cache.stride(0), kv_cache.stride(1), lay.v_codes, lay.k_params, lay.v_params,
        num_kv_heads, head_dim, block_size,
        K_KIND=k_kind, V_KIND=v_kind, BLOCK_H=triton.next_power_of_2(num_kv_heads),
        BLOCK_D=triton.next_power_of_2(head_dim))


def _quant_layout(kv_cache: torch.Tensor, kv_quant: KVQuantFormat, head_dim: int,
                  kv_scale: torch.Tensor | None):
    """block_size and section offsets of a quantized cache, with the checks both kernels need."""
    _, _, block_bytes = kv_cache.shape
    assert kv_cache.dtype == torch.uint8 and kv_cache.stride(-1) == 1, (kv_cache.dtype, kv_cache.stride())
    assert kv_quant.k_kind != "int4", "int4 is for V only (k8v4)"
    assert kv_quant.v_kind != "int4" or head_dim % 2 == 0, "int4 packs dim pairs: head_dim must be even"
    if kv_quant.uses_tensor_scales:
        assert kv_scale is not None and kv_scale.dtype == torch.float32 and kv_scale.numel() == 2, \
            "fp8 KV caches need the layer's kv_scale, (2,) float32"
    block_size = block_bytes // kv_quant.bytes_per_token(head_dim)
    lay = kv_quant.layout(block_size, head_dim)
    assert lay.block_bytes == block_bytes, (kv_cache.shape, kv_quant, head_dim)
    return block_size, lay


# ---- attention ----------------------------------------------------------------------------------
@triton.jit
def _find_request(query_start_loc_ptr, num_reqs, q_block, BLOCK_Q: tl.constexpr):
    """The request owning q block `q_block`: the last i with query_start_loc[i] // BLOCK_Q + i <= q_block."""
    lo: tl.int32 = 0
    hi: tl.int32 = num_reqs  # the first request starting past q_block lies in [lo, hi]
    while lo < hi:
        mid = (lo + hi) // 2
        if tl.load(query_start_loc_ptr + mid) // BLOCK_Q + mid <= q_block:
            lo = mid + 1
        else:
            hi = mid
    return lo - 1


@triton.jit
def _paged_attention_kernel(
        out_ptr, query_ptr, cache_ptr, kv_scale_ptr, sink_logits_ptr, block_tables_ptr, query_start_loc_ptr,
        seq_lens_ptr, scale_log2, num_reqs, head_dim, window, sink_tokens, soft_cap_log2, two_over_soft_cap,
        query_stride_t, query_stride_h, out_stride_t, out_stride_h,
        cache_stride_block, cache_stride_h, k_slot_stride, v_offset, v_slot_stride, k_params_offset,
        v_params_offset, block_table_stride,
        K_KIND: tl.constexpr, V_KIND: tl.constexpr, QUERIES_PER_KV: tl.constexpr, HEADS_PADDED: tl.constexpr,
        BLOCK_Q: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_V: tl.constexpr, TILE_N: tl.constexpr,
        KV_BLOCK_SIZE: tl.constexpr, USE_WINDOW: tl.constexpr, USE_SOFT_CAP: tl.constexpr,
        USE_SINK_LOGITS: tl.constexpr, DOT_PRECISION: tl.constexpr):
    BLOCK_M: tl.constexpr = BLOCK_Q * HEADS_PADDED
    q_block = tl.program_id(0)
    kv_head = tl.program_id(1)
    dot_dtype = query_ptr.dtype.element_ty

    # 1. which request, which of its query tokens
    req = _find_request(query_start_loc_ptr, num_reqs, q_block, BLOCK_Q)
    q_start = tl.load(query_start_loc_ptr + req)
    q_len = tl.load(query_start_loc_ptr + req + 1) - q_start
    first_token = (q_block - (q_start // BLOCK_Q + req)) * BLOCK_Q
    if first_token >= q_len:
        return
    seq_len = tl.load(seq_lens_ptr + req)
    context_len = seq_len - q_len  # cached tokens before this chunk

    rows = tl.arange(0, BLOCK_M)
    token = first_token + rows // HEADS_PADDED  # (BLOCK_M,) index within the chunk
    head_in_group = rows % HEADS_PADDED
    head = kv_head * QUERIES_PER_KV + head_in_group
    row_valid = (token < q_len) & (head_in_group < QUERIES_PER_KV)
    q_pos = context_len + token  # (BLOCK_M,) absolute position of each row's query
    dims = tl.arange(0, BLOCK_D)
    dim_valid = dims < head_dim
    # V's dims: all of them, or with int4 the low half (the high half is a second accumulator)
    v_dims = tl.arange(0, BLOCK_V)
    if V_KIND == _INT4:
        v_dim_valid = v_dims < head_dim // 2
    else:
        v_dim_valid = v_dims < head_dim

    q = tl.load(query_ptr + (q_start + token)[:, None] * query_stride_t + head[:, None] * query_stride_h
                + dims[None, :], mask=row_valid[:, None] & dim_valid[None, :], other=0.0)

    # per-tensor fp8 scales, read on the device so a CUDA graph replays with the current ones
    k_factor = scale_log2
    if K_KIND == _E4M3:
        k_factor = scale_log2 * tl.load(kv_scale_ptr) * _E4M3_AS_F16
    elif K_KIND == _E5M2:
        k_factor = scale_log2 * tl.load(kv_scale_ptr)

    # 2. the keys this block can see: causal up to its last query, within the window of its first
    #    one, plus the sinks below that window
    last_token = tl.minimum(first_token + BLOCK_Q, q_len) - 1
    kv_end = context_len + last_token + 1
    kv_start = 0
    sink_end = 0
    if USE_WINDOW:
        kv_start = tl.maximum(context_len + first_token - window + 1, 0)
        sink_end = tl.minimum(sink_tokens, kv_start)
    num_sink_tiles = tl.cdiv(sink_end, TILE_N)
    num_tiles = num_sink_tiles + tl.cdiv(kv_end - kv_start, TILE_N)

    # 3. online softmax over key tiles: the sink tiles [0, sink_end), then [kv_start, kv_end)
    m_i = tl.full([BLOCK_M], -1.0e30, dtype=tl.float32)  # finite: a fully masked tile gives no NaN
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    if USE_SINK_LOGITS:  # each head's sink starts its row as a key of weight exp(sink) and no value
        sink = tl.load(sink_logits_ptr + head, mask=row_valid, other=0.0).to(tl.float32)
        m_i = tl.where(row_valid, sink * 1.4426950408889634, m_i)  # log2 domain, as the scores
        l_i = tl.where(row_valid, 1.0, l_i)
    acc = tl.zeros([BLOCK_M, BLOCK_V], dtype=tl.float32)
    if V_KIND == _INT4:
        acc_hi = tl.zeros([BLOCK_M, BLOCK_V], dtype=tl.float32)
    block_table = block_tables_ptr + req * block_table_stride
    head_base = kv_head.to(tl.int64) * cache_stride_h
    for i in range(0, num_tiles):
        in_sinks = i < num_sink_tiles
        tile_start = tl.where(in_sinks, i * TILE_N, kv_start + (i - num_sink_tiles) * TILE_N)
        keys = tile_start + tl.arange(0, TILE_N)
        key_valid = keys < tl.where(in_sinks, sink_end, kv_end)
        block_ids = tl.load(block_table + keys // KV_BLOCK_SIZE, mask=key_valid, other=0).to(tl.int64)
        base = block_ids * cache_stride_block + head_base  # (TILE_N,) this head's part of each key's block
        slots = keys % KV_BLOCK_SIZE

        k = _load_kv_tile(cache_ptr + (base + slots * k_slot_stride)[None, :] + dims[:, None],
                          key_valid[None, :] & dim_valid[:, None], K_KIND, dot_dtype)  # (BLOCK_D, TILE_N)
        scores = tl.dot(q, k, input_precision=DOT_PRECISION) * k_factor  # (BLOCK_M, TILE_N)
        if K_KIND == _INT8:
            scores = scores * _load_f16(cache_ptr + base + k_params_offset + slots * 2, key_valid)[None, :]
        if USE_SOFT_CAP:
            # cap * tanh(s / cap) on the natural-log score s = scores / log2(e), back in log2 units:
            # tanh(y) = 1 - 2 / (e^(2y) + 1), and e^(2y) = 2^(2 * scores / cap) (saturates to +-1)
            scores = soft_cap_log2 * (1.0 - 2.0 / (tl.exp2(scores * two_over_soft_cap) + 1.0))
        visible = key_valid[None, :] & (keys[None, :] <= q_pos[:, None])
        if USE_WINDOW:
            visible = visible & ((keys[None, :] > q_pos[:, None] - window) | (keys[None, :] < sink_tokens))
        scores = tl.where(visible, scores, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(scores, 1))
        p = tl.exp2(scores - m_new[:, None])
        alpha = tl.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)

        v_ptrs = cache_ptr + (base + v_offset + slots * v_slot_stride)[:, None] + v_dims[None, :]
        v_mask = key_valid[:, None] & v_dim_valid[None, :]
        if V_KIND == _INT4:
            packed = tl.load(v_ptrs, mask=v_mask, other=0)  # (TILE_N, BLOCK_V): dims d and d + D/2
            params = cache_ptr + base + v_params_offset + slots * 4
            pv = (p * _load_f16(params, key_valid)[None, :]).to(dot_dtype)  # P times each key's step
            v_bias = tl.sum(p * _load_f16(params + 2, key_valid)[None, :], 1)[:, None]  # sum p_j * min_j
            acc = (acc * alpha[:, None] + v_bias
                   + tl.dot(pv, _int_codes_as(packed & 0xF, dot_dtype), input_precision=DOT_PRECISION))
            acc_hi = (acc_hi * alpha[:, None] + v_bias
                      + tl.dot(pv, _int_codes_as(packed >> 4, dot_dtype), input_precision=DOT_PRECISION))
        else:
            v = _load_kv_tile(v_ptrs, v_mask, V_KIND, dot_dtype)  # (TILE_N, BLOCK_V)
            if V_KIND == _INT8:
                p = p * _load_f16(cache_ptr + base + v_params_offset + slots * 2, key_valid)[None, :]
            acc = acc * alpha[:, None] + tl.dot(p.to(dot_dtype), v, input_precision=DOT_PRECISION)
        m_i = m_new

    # 4. normalize; a row that saw no key (padding with seq_len 0) stays 0
    denom = tl.where(l_i > 0.0, l_i, 1.0)[:, None]
    acc = acc / denom
    if V_KIND == _E4M3:
        acc = acc * (tl.load(kv_scale_ptr + 1) * _E4M3_AS_F16)
    elif V_KIND == _E5M2:
        acc = acc * tl.load(kv_scale_ptr + 1)
    out_ptrs = (out_ptr + (q_start + token)[:, None] * out_stride_t + head[:, None] * out_stride_h
                + v_dims[None, :])
    out_mask = row_valid[:, None] & v_dim_valid[None, :]
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=out_mask)
    if V_KIND == _INT4:
        tl.store(out_ptrs + head_dim // 2, (acc_hi / denom).to(out_ptr.dtype.element_ty), mask=out_mask)


def attention_tiling(num_queries_per_kv: int, max_query_len: int, head_dim: int,
                     dtype: torch.dtype) -> dict[str, int]:
    """Launch parameters. Rows of the score tile (BLOCK_M, >= 16 as tl.dot needs) hold BLOCK_Q
    tokens x the query heads of one KV head; a decode-only batch takes one token per program. Key
    tiles shrink as head rows widen (head_dim x element size of the dot's dtype, the query's: a
    quantized or other-dtype tile is converted to it) so shared memory stays under ~100 KiB
    (sm_80 / sm_90 compiles checked in tests/kernels/test_triton_compile.py)."""
    heads_padded = triton.next_power_of_2(num_queries_per_kv)
    block_m = max(16 if max_query_len <= 1 else 64, heads_padded)
    block_d = max(16, triton.next_power_of_2(head_dim))
    row_bytes = block_d * torch.empty((), dtype=dtype).element_size()
    tile_n = 64 if row_bytes <= 256 else 32 if row_bytes <= 512 else 16
    return {"HEADS_PADDED": heads_padded, "BLOCK_Q": block_m // heads_padded, "BLOCK_D": block_d,
            "TILE_N": tile_n, "num_warps": 4 if block_m <= 16 else 8, "num_stages": 2}


def cache_addressing(kv_cache: torch.Tensor, head_dim: int, kv_quant: KVQuantFormat | None,
                     kv_scale: torch.Tensor | None = None) -> dict[str, int]:
    """Where the attention kernel finds K and V of (block, head, slot), for either layout: the
    kernel's block_size, strides and byte offsets (see the module docstring)."""
    if kv_quant is None:
        _, _, block_size, _, cache_head_dim = kv_cache.shape
        assert cache_head_dim == head_dim, (kv_cache.shape, head_dim)
        return dict(block_size=block_size, cache_stride_block=kv_cache.stride(1),
                    cache_stride_h=kv_cache.stride(3), k_slot_stride=kv_cache.stride(2),
                    v_offset=kv_cache.stride(0), v_slot_stride=kv_cache.stride(2),
                    k_params_offset=0, v_params_offset=0)
    block_size, lay = _quant_layout(kv_cache, kv_quant, head_dim, kv_scale)
    return dict(block_size=block_size, cache_stride_block=kv_cache.stride(1),
                cache_stride_h=kv_cache.stride(0), k_slot_stride=head_dim, v_offset=lay.v_codes,
                v_slot_stride=KVQuantFormat.code_bytes(kv_quant.v_kind, head_dim),
                k_params_offset=lay.k_params, v_params_offset=lay.v_params)


def paged_attention(query: torch.Tensor, kv_cache: torch.Tensor, query_start_loc: torch.Tensor,
                    seq_lens: torch.Tensor, block_tables: torch.Tensor, num_reqs: int, max_query_len: int,
                    scale: float, sliding_window: int | None = None, out: torch.Tensor | None = None,
                    tile_n: int | None = None, *, sink_tokens: int = 0, kv_quant: KVQuantFormat | None = None,
                    kv_scale: torch.Tensor | None = None, logits_soft_cap: float | None = None,
                    sink_logits: torch.Tensor | None = None) -> torch.Tensor:
    """query (num_tokens, num_heads, head_dim) packed per query_start_loc (num_reqs + 1,), over
    kv_cache -> (num_tokens, num_heads, head_dim) in the query's dtype. kv_cache is the float layout
    (2, num_blocks, block_size, num_kv_heads, head_dim), in any float dtype, or with kv_quant the
    quantized (num_kv_heads, num_blocks, block_bytes) uint8 one (fp8 scaled by kv_scale (2,)).

    seq_lens (num_reqs,) is each request's context after this step; block_tables (num_reqs, W) its
    blocks. With a window the first sink_tokens keys stay visible. `logits_soft_cap` c bends each
    scaled score s to c * tanh(s / c) before masking (Gemma 2). `sink_logits` (num_heads,) float32: each
    head's learned logit joins its softmax denominators (gpt-oss). Sizes passed as ints (num_reqs,
    max_query_len) are host values: no device sync."""
    num_tokens, num_heads, head_dim = query.shape
    num_kv_heads = kv_cache.shape[3] if kv_quant is None else kv_cache.shape[0]
    assert num_heads % num_kv_heads == 0, (query.shape, kv_cache.shape)
    assert query.stride(-1) == 1 and kv_cache.stride(-1) == 1
    addressing = cache_addressing(kv_cache, head_dim, kv_quant, kv_scale)
    block_size = addressing.pop("block_size")
    if out is None:
        out = torch.empty(query.shape, dtype=query.dtype, device=query.device)
    if num_tokens == 0 or num_reqs == 0:
        return out
    tiling = attention_tiling(num_heads // num_kv_heads, max_query_len, head_dim, query.dtype)
    if tile_n is not None:
        tiling["TILE_N"] = tile_n
    k_kind, v_kind = kind_ids(kv_quant)
    block_v = tiling["BLOCK_D"]  # V's tile width: int4 is two tiles of D/2
    if v_kind == KIND_IDS["int4"]:
        block_v = max(16, triton.next_power_of_2(head_dim // 2))
    grid = (num_tokens // tiling["BLOCK_Q"] + num_reqs, num_kv_heads)
    _paged_attention_kernel[grid](
        out, query, kv_cache, kv_scale if kv_quant is not None and kv_quant.uses_tensor_scales else None,
        sink_logits, block_tables, query_start_loc, seq_lens,
        scale * LOG2E, num_reqs, head_dim, sliding_window or 0, sink_tokens if sliding_window else 0,
        (logits_soft_cap or 1.0) * LOG2E, 2.0 / (logits_soft_cap or 1.0),
        query.stride(0), query.stride(1), out.stride(0), out.stride(1),
        **addressing, block_table_stride=block_tables.stride(0),
        K_KIND=k_kind, V_KIND=v_kind, QUERIES_PER_KV=num_heads // num_kv_heads, BLOCK_V=block_v,
        KV_BLOCK_SIZE=block_size, USE_WINDOW=sliding_window is not None, USE_SOFT_CAP=logits_soft_cap is not None,
        USE_SINK_LOGITS=sink_logits is not None,
        DOT_PRECISION="ieee" if query.dtype == torch.float32 else None, **tiling)
    return out
