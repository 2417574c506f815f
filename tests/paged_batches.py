"""Random paged attention batches shared by the backend tests (tests/attention, tests/kernels)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvtide.attention.backend import AttentionMetadata


@dataclass
class PagedBatch:
    query: torch.Tensor
    """(num_tokens, num_heads, head_dim)"""
    key: torch.Tensor
    """(num_tokens, num_kv_heads, head_dim), this step's new keys"""
    value: torch.Tensor
    kv_cache: torch.Tensor
    """(2, num_blocks, block_size, num_kv_heads, head_dim), random everywhere (cached prefixes too)"""
    metadata: AttentionMetadata


def make_paged_batch(requests: list[tuple[int, int]], num_heads: int, num_kv_heads: int, head_dim: int,
                     block_size: int, dtype: torch.dtype, device: torch.device | str = "cpu", seed: int = 0,
                     table_width: int | None = None) -> PagedBatch:
    """A batch of requests given as (query_len, cached_len): query_len new tokens after cached_len
    tokens already in the cache (a prefix hit or earlier chunks). Decodes (query_len 1) are moved to
    the front as the layout requires; blocks are scattered over the pool in random order.

        cached_len = 5, query_len = 3, block_size = 4:
        positions  0 1 2 3 | 4 5 6 7        block table [b7, b2]
                   c c c c | c n n n        c: cached (random), n: written this step at slot_mapping
    """
    gen = torch.Generator().manual_seed(seed)
    reqs = sorted(requests, key=lambda r: r[0] != 1)
    seq_lens = [q + c for q, c in reqs]
    blocks_per_req = [-(-s // block_size) for s in seq_lens]
    num_blocks = sum(blocks_per_req) + 3
    free = torch.randperm(num_blocks, generator=gen).tolist()
    width = table_width or max(blocks_per_req)
    tables = []
    for n in blocks_per_req:
        tables.append(free[:n] + [0] * (width - n))
        free = free[n:]
    slots = []
    for (q, c), table in zip(reqs, tables, strict=True):
        slots.extend(table[p // block_size] * block_size + p % block_size for p in range(c, c + q))
    query_start_loc = [0]
    for q, _ in reqs:
        query_start_loc.append(query_start_loc[-1] + q)
    num_tokens = query_start_loc[-1]

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen).to(dtype=dtype, device=device)

    metadata = AttentionMetadata(
        num_reqs=len(reqs), num_decodes=sum(1 for q, _ in reqs if q == 1), num_actual_tokens=num_tokens,
        query_start_loc=torch.tensor(query_start_loc, dtype=torch.int32, device=device),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
        block_tables=torch.tensor(tables, dtype=torch.int32, device=device),
        slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device),
        max_query_len=max(q for q, _ in reqs), max_seq_len=max(seq_lens), block_size=block_size,
        query_start_loc_cpu=query_start_loc, seq_lens_cpu=seq_lens)
    return PagedBatch(randn(num_tokens, num_heads, head_dim), randn(num_tokens, num_kv_heads, head_dim),
                      randn(num_tokens, num_kv_heads, head_dim),
                      randn(2, num_blocks, block_size, num_kv_heads, head_dim), metadata)




def quantized_cache(float_cache: torch.Tensor, kv_quant, kv_scale: torch.Tensor) -> torch.Tensor:
    """A reference-layout float cache (2, num_blocks, block_size, H_kv, D), every slot written through
    the reference codec into `kv_quant`'s byte layout (H_kv, num_blocks, block_bytes)."""
    _, num_blocks, block_size, num_kv_heads, head_dim = float_cache.shape
    cache = torch.zeros(kv_quant.cache_shape(num_blocks, block_size, num_kv_heads, head_dim), dtype=torch.uint8,
                        device=float_cache.device)
    slots = torch.arange(num_blocks * block_size, device=float_cache.device)
    flat = float_cache.reshape(2, num_blocks * block_size, num_kv_heads, head_dim)
    kv_quant.write(flat[0], flat[1], cache, slots, kv_scale)
    return cache
