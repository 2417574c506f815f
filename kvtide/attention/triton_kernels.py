"""Triton kernels over the paged KV cache: writing new K/V at the slot mapping, and one attention
kernel for a whole packed batch (decodes and prefill chunks over a cached prefix alike).

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

Keys are gathered per position through the block table, so any power-of-two KV block size works
with any key tile (TILE_N):

    key j of request i lives at  kv_cache[.., block_tables[i, j // block_size], j % block_size, h, :]

Query token t of a chunk of q_len tokens over seq_len context tokens sits at position
seq_len - q_len + t and sees key j iff  j <= position  (and j > position - window).
Scores and the online softmax are float32; P is cast to the cache dtype for the P @ V product.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

LOG2E = math.log2(math.e)


# ---- writing K/V --------------------------------------------------------------------------------
@triton.jit
def _write_kv_kernel(key_ptr, value_ptr, cache_ptr, slot_mapping_ptr,
                     key_stride_t, key_stride_h, value_stride_t, value_stride_h,
                     cache_stride_kv, cache_stride_block, cache_stride_slot, cache_stride_h,
                     num_kv_heads, head_dim, block_size,
                     BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr):
    token = tl.program_id(0)
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    heads = tl.arange(0, BLOCK_H)
    dims = tl.arange(0, BLOCK_D)
    # A negative slot is a padding token (CUDA-graph buckets): no head is written.
    heads_to_write = tl.where(slot >= 0, num_kv_heads, 0)
    mask = (heads[:, None] < heads_to_write) & (dims[None, :] < head_dim)
    dst = (cache_ptr + (slot // block_size) * cache_stride_block + (slot % block_size) * cache_stride_slot
           + heads[:, None] * cache_stride_h + dims[None, :])
    key = tl.load(key_ptr + token * key_stride_t + heads[:, None] * key_stride_h + dims[None, :], mask=mask)
    tl.store(dst, key, mask=mask)
    value = tl.load(value_ptr + token * value_stride_t + heads[:, None] * value_stride_h + dims[None, :],
                    mask=mask)
    tl.store(dst + cache_stride_kv, value, mask=mask)


def write_kv_cache(key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor,
                   slot_mapping: torch.Tensor) -> None:
    """key, value (num_tokens, num_kv_heads, head_dim) into kv_cache
    (2, num_blocks, block_size, num_kv_heads, head_dim) at slot_mapping (num_tokens,); slot -1 skips."""
    num_tokens = slot_mapping.shape[0]
    if num_tokens == 0:
        return
    _, _, block_size, num_kv_heads, head_dim = kv_cache.shape
    assert key.stride(-1) == 1 and value.stride(-1) == 1 and kv_cache.stride(-1) == 1
    assert key.shape[0] >= num_tokens and key.shape[1:] == (num_kv_heads, head_dim), key.shape
    _write_kv_kernel[(num_tokens,)](
        key, value, kv_cache, slot_mapping,
        key.stride(0), key.stride(1), value.stride(0), value.stride(1),
        kv_cache.stride(0), kv_cache.stride(1), kv_cache.stride(2), kv_cache.stride(3),
        num_kv_heads, head_dim, block_size,
        BLOCK_H=triton.next_power_of_2(num_kv_heads), BLOCK_D=triton.next_power_of_2(head_dim))


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
        out_ptr, query_ptr, cache_ptr, block_tables_ptr, query_start_loc_ptr, seq_lens_ptr,
        scale_log2, num_reqs, head_dim, window,
        query_stride_t, query_stride_h, out_stride_t, out_stride_h,
        cache_stride_kv, cache_stride_block, cache_stride_slot, cache_stride_h, block_table_stride,
        QUERIES_PER_KV: tl.constexpr, HEADS_PADDED: tl.constexpr, BLOCK_Q: tl.constexpr,
        BLOCK_D: tl.constexpr, TILE_N: tl.constexpr, KV_BLOCK_SIZE: tl.constexpr,
        USE_WINDOW: tl.constexpr, DOT_PRECISION: tl.constexpr):
    BLOCK_M: tl.constexpr = BLOCK_Q * HEADS_PADDED
    q_block = tl.program_id(0)
    kv_head = tl.program_id(1)

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

    q = tl.load(query_ptr + (q_start + token)[:, None] * query_stride_t + head[:, None] * query_stride_h
                + dims[None, :], mask=row_valid[:, None] & dim_valid[None, :], other=0.0)

    # 2. the keys this block can see: causal up to its last query, and within the window
    last_token = tl.minimum(first_token + BLOCK_Q, q_len) - 1
    kv_end = context_len + last_token + 1
    kv_start = 0
    if USE_WINDOW:
        kv_start = tl.maximum(context_len + first_token - window + 1, 0)

    # 3. online softmax over key tiles
    m_i = tl.full([BLOCK_M], -1.0e30, dtype=tl.float32)  # finite: a fully masked tile gives no NaN
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    block_table = block_tables_ptr + req * block_table_stride
    for tile_start in range(kv_start, kv_end, TILE_N):
        keys = tile_start + tl.arange(0, TILE_N)
        key_valid = keys < kv_end
        block_ids = tl.load(block_table + keys // KV_BLOCK_SIZE, mask=key_valid, other=0).to(tl.int64)
        offsets = (block_ids * cache_stride_block + (keys % KV_BLOCK_SIZE) * cache_stride_slot
                   + kv_head * cache_stride_h)  # (TILE_N,)
        k = tl.load(cache_ptr + offsets[None, :] + dims[:, None],
                    mask=key_valid[None, :] & dim_valid[:, None], other=0.0)  # (BLOCK_D, TILE_N)
        scores = tl.dot(q, k, input_precision=DOT_PRECISION) * scale_log2  # (BLOCK_M, TILE_N)
        visible = key_valid[None, :] & (keys[None, :] <= q_pos[:, None])
        if USE_WINDOW:
            visible = visible & (keys[None, :] > q_pos[:, None] - window)
        scores = tl.where(visible, scores, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(scores, 1))
        p = tl.exp2(scores - m_new[:, None])
        alpha = tl.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(cache_ptr + cache_stride_kv + offsets[:, None] + dims[None, :],
                    mask=key_valid[:, None] & dim_valid[None, :], other=0.0)  # (TILE_N, BLOCK_D)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        m_i = m_new

    # 4. normalize; a row that saw no key (padding with seq_len 0) stays 0
    acc = acc / tl.where(l_i > 0.0, l_i, 1.0)[:, None]
    tl.store(out_ptr + (q_start + token)[:, None] * out_stride_t + head[:, None] * out_stride_h
             + dims[None, :], acc.to(out_ptr.dtype.element_ty),
             mask=row_valid[:, None] & dim_valid[None, :])


def attention_tiling(num_queries_per_kv: int, max_query_len: int, head_dim: int,
                     dtype: torch.dtype) -> dict[str, int]:
    """Launch parameters. Rows of the score tile (BLOCK_M, >= 16 as tl.dot needs) hold BLOCK_Q
    tokens x the query heads of one KV head; a decode-only batch takes one token per program. Key
    tiles shrink as head rows widen (head_dim x element size) so shared memory stays under ~100 KiB
    (sm_80 / sm_90 compiles checked in tests/kernels/test_triton_compile.py)."""
    heads_padded = triton.next_power_of_2(num_queries_per_kv)
    block_m = max(16 if max_query_len <= 1 else 64, heads_padded)
    block_d = max(16, triton.next_power_of_2(head_dim))
    row_bytes = block_d * torch.empty((), dtype=dtype).element_size()
    tile_n = 64 if row_bytes <= 256 else 32 if row_bytes <= 512 else 16
    return {"HEADS_PADDED": heads_padded, "BLOCK_Q": block_m // heads_padded, "BLOCK_D": block_d,
            "TILE_N": tile_n, "num_warps": 4 if block_m <= 16 else 8, "num_stages": 2}


def paged_attention(query: torch.Tensor, kv_cache: torch.Tensor, query_start_loc: torch.Tensor,
                    seq_lens: torch.Tensor, block_tables: torch.Tensor, num_reqs: int, max_query_len: int,
                    scale: float, sliding_window: int | None = None, out: torch.Tensor | None = None,
                    tile_n: int | None = None) -> torch.Tensor:
    """query (num_tokens, num_heads, head_dim) packed per query_start_loc (num_reqs + 1,), over
    kv_cache (2, num_blocks, block_size, num_kv_heads, head_dim) -> (num_tokens, num_heads, head_dim).

    seq_lens (num_reqs,) is each request's context after this step; block_tables (num_reqs, W) its
    blocks. Sizes passed as ints (num_reqs, max_query_len) are host values: no device sync."""
    num_tokens, num_heads, head_dim = query.shape
    _, _, block_size, num_kv_heads, cache_head_dim = kv_cache.shape
    assert cache_head_dim == head_dim and num_heads % num_kv_heads == 0, (query.shape, kv_cache.shape)
    assert query.stride(-1) == 1 and kv_cache.stride(-1) == 1
    if out is None:
        out = torch.empty(query.shape, dtype=query.dtype, device=query.device)
    if num_tokens == 0 or num_reqs == 0:
        return out
    tiling = attention_tiling(num_heads // num_kv_heads, max_query_len, head_dim, query.dtype)
    if tile_n is not None:
        tiling["TILE_N"] = tile_n
    grid = (num_tokens // tiling["BLOCK_Q"] + num_reqs, num_kv_heads)
    _paged_attention_kernel[grid](
        out, query, kv_cache, block_tables, query_start_loc, seq_lens,
        scale * LOG2E, num_reqs, head_dim, sliding_window or 0,
        query.stride(0), query.stride(1), out.stride(0), out.stride(1),
        kv_cache.stride(0), kv_cache.stride(1), kv_cache.stride(2), kv_cache.stride(3),
        block_tables.stride(0),
        QUERIES_PER_KV=num_heads // num_kv_heads, KV_BLOCK_SIZE=block_size,
        USE_WINDOW=sliding_window is not None,
        DOT_PRECISION="ieee" if query.dtype == torch.float32 else None, **tiling)
    return out
