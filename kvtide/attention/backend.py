"""The attention backend interface and the metadata every backend receives.

Tokens arrive flat and packed (no padding); decode requests (one query token) come first:

    tokens:          [ d0 | d1 | d2 | p0 p0 p0 p0 | p1 p1 ]      3 decodes, 2 prefill chunks
    query_start_loc: [ 0,   1,   2,   3,            7,    9 ]
    seq_lens:        [ 40,  17,  90,  4 + cached0,  2 + cached1 ]   context length after this step
    block_tables:    (num_reqs, max_blocks) block ids, padded with 0 (masked by seq_lens)
    slot_mapping:    (num_tokens,) block_id * block_size + offset where each new K/V is written

Which keys a query at position p sees: j <= p, and with a window W, j > p - W, except that the
first `sink_tokens` keys stay visible (StreamingLLM's attention sinks; 0 without a window).

Learned sink logits (gpt-oss), a different thing: one extra logit per query head, `sink_logits`
(num_heads,), joins every query's softmax denominator and attends to nothing, so a head can give
less than all of its weight to the keys.

The cache is in the backend's float layout, or, with a quantized `kv_quant` format, the shared byte
layout of kv_compression/formats.py: (num_kv_heads, num_blocks, block_bytes) uint8, dequantized
inside attention with the layer's `kv_scale` (2,) float32 tensor (fp8's per-tensor K and V scales).
"""

from __future__ import annotations

import abc
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from kvtide.kv_compression.formats import KVQuantFormat


@dataclass
class AttentionMetadata:
    num_reqs: int
    num_decodes: int
    """Requests with exactly one query token; they are the first `num_decodes` requests."""
    num_actual_tokens: int
    query_start_loc: torch.Tensor
    """(num_reqs + 1,) int32, cumulative query lengths."""
    seq_lens: torch.Tensor
    """(num_reqs,) int32, tokens in each request's context after this step."""
    block_tables: torch.Tensor
    """(num_reqs, max_num_blocks) int32."""
    slot_mapping: torch.Tensor
    """(num_tokens,) int64, cache slot of each new token."""
    max_query_len: int
    max_seq_len: int
    block_size: int
    query_start_loc_cpu: list[int] = field(default_factory=list)
    seq_lens_cpu: list[int] = field(default_factory=list)
    row_uids: list[int] = field(default_factory=list)
    """Per request row, an id unique to that request's life in the runner: a row with the same uid
    as in the previous step is the same sequence, one token longer (a backend may keep state)."""
    backend_data: dict = field(default_factory=dict)
    """The backends' own per-step cache: tensors a backend (or an attention layer's own path)
    derives from this metadata once and reuses in every layer, under a key it owns (e.g.
    "cpu_row_split"). Nothing else travels through it: data for the layers is a named field."""
    attention_mass: torch.Tensor | None = None
    """The score drop policy's accumulator, (num_reqs, max_num_blocks) float32, zeroed each step:
    every attention layer adds, per request row and block, the softmax weights its queries gave
    that block's keys, summed over heads and queries (kv_compression/attention_mass.py). None
    without the policy."""
    has_dropped_blocks: bool = False
    """Some block table entries are -1: blocks the KV drop policy removed, which no query attends
    (their positions keep counting, for rotary embeddings and the causal mask)."""
    groups: list[AttentionMetadata] | None = None
    """Layer groups with tables of their own (kv_cache/hybrid.py): group g's metadata, which differs
    only in block_tables and slot_mapping, for the layers of group g (this object is group 0's)."""


class AttentionBackend(abc.ABC):
    """Writes new K/V into the paged cache and computes attention for a packed batch."""

    name: str = ""
    supports_logits_soft_cap = True
    """Whether `forward` applies `logits_soft_cap` (Gemma 2's cap * tanh(score / cap)); a backend
    that cannot says so, and a capped attention layer (layers/attention.py) then refuses to run on
    it with a ValueError naming the backend, never attending uncapped."""
    supports_attention_sinks = True
    """Whether `forward` applies `sink_logits` (gpt-oss's learned per-head sink logit in every
    softmax denominator); an attention layer with sinks refuses a backend that cannot, by name."""

    def __init__(self, kv_quant: KVQuantFormat | None = None) -> None:
        self.kv_quant = kv_quant
        """The quantized cache format, or None: K/V stored as floats in the cache tensor's dtype."""

    def kv_cache_shape(self, num_blocks: int, block_size: int, num_kv_heads: int,
                       head_dim: int) -> tuple[int, ...]:
        """Shape of one layer's cache: this float layout unless a backend needs another, and the
        shared byte layout for a quantized format."""
        if self.kv_quant is not None:
            return self.kv_quant.cache_shape(num_blocks, block_size, num_kv_heads, head_dim)
        return self.float_cache_shape(num_blocks, block_size, num_kv_heads, head_dim)

    def float_cache_shape(self, num_blocks: int, block_size: int, num_kv_heads: int,
                          head_dim: int) -> tuple[int, ...]:
        return (2, num_blocks, block_size, num_kv_heads, head_dim)

    def copy_blocks(self, kv_cache: torch.Tensor, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Copy whole blocks src[i] -> dst[i] (copy-on-write after a fork)."""
        if self.kv_quant is not None:
            kv_cache[:, dst] = kv_cache[:, src]
        else:
            self.copy_float_blocks(kv_cache, src, dst)

    def copy_float_blocks(self, kv_cache: torch.Tensor, src: torch.Tensor, dst: torch.Tensor) -> None:
        kv_cache[:, dst] = kv_cache[:, src]

    def gather_blocks(self, kv_cache: torch.Tensor, block_ids: torch.Tensor, head_dim: int,
                      kv_scale: torch.Tensor | None, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of blocks `block_ids` (N,) int64, as (N * block_size, H_kv, D) in `dtype`, for code
        outside attention that reads the cache (the drop policy's attention mass)."""
        if self.kv_quant is not None:
            assert kv_scale is not None, "a quantized KV cache needs the layer's kv_scale"
            key, value = self.kv_quant.read_blocks(kv_cache.index_select(1, block_ids), head_dim, kv_scale, dtype)
            return key.transpose(0, 1), value.transpose(0, 1)
        return self.gather_float_blocks(kv_cache, block_ids, head_dim, dtype)

    def gather_float_blocks(self, kv_cache: torch.Tensor, block_ids: torch.Tensor, head_dim: int,
                            dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        kv = kv_cache.index_select(1, block_ids).view(2, -1, kv_cache.shape[3], head_dim).to(dtype)
        return kv[0], kv[1]

    @abc.abstractmethod
    def write_kv(self, key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor,
                 slot_mapping: torch.Tensor, kv_scale: torch.Tensor | None = None) -> None:
        """key, value (num_tokens, num_kv_heads, head_dim) into kv_cache at slot_mapping
        (quantized with kv_scale when the format is)."""

    @abc.abstractmethod
    def forward(self, query: torch.Tensor, kv_cache: torch.Tensor, metadata: AttentionMetadata,
                scale: float, sliding_window: int | None, key: torch.Tensor | None = None,
                value: torch.Tensor | None = None, *, sink_tokens: int = 0,
                kv_scale: torch.Tensor | None = None, logits_soft_cap: float | None = None,
                sink_logits: torch.Tensor | None = None) -> torch.Tensor:
        """query (num_tokens, num_heads, head_dim) -> (num_tokens, num_heads, head_dim), each query
        attending to its request's cached context causally (within the window, plus the sinks).
        `logits_soft_cap` c: every scaled score s becomes c * tanh(s / c) before masking and softmax.
        `sink_logits` (num_heads,): each head's learned logit, added to its softmax denominator.
        key/value are this step's new K/V (already in the cache), which a backend may read instead
        of the cache (unquantized: a quantized cache's attention reads the dequantized codes)."""


def prefill_mask(q_len: int, seq_len: int, window: int | None, device: torch.device,
                 sink_tokens: int = 0, key_valid: torch.Tensor | None = None) -> torch.Tensor | None:
    """(q_len, seq_len) bool mask for a chunk of q_len queries ending a context of seq_len: query i
    sits at position seq_len - q_len + i and sees keys j <= that position (and j > it - window, or
    j < sink_tokens), and only keys whose `key_valid` (>= seq_len,) is set. None when plain causal
    attention (SDPA's is_causal) is exactly that."""
    if seq_len == q_len and window is None and key_valid is None:
        return None
    q_pos = torch.arange(seq_len - q_len, seq_len, device=device)[:, None]
    k_pos = torch.arange(seq_len, device=device)[None, :]
    mask = k_pos <= q_pos
    if window is not None:
        mask &= (k_pos > q_pos - window) | (k_pos < sink_tokens)
    if key_valid is not None:
        mask &= key_valid[None, :seq_len]
    return mask


def request_blocks(md: AttentionMetadata, row: int, num_blocks: int) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Row `row`'s first num_blocks block ids as int64, with dropped (-1) entries replaced by block 0,
    and which of their positions hold attendable keys ((num_blocks * block_size,) bool), or None
    when no block of the step is dropped."""
    ids = md.block_tables[row, :num_blocks].to(torch.int64)
    if not md.has_dropped_blocks:
        return ids, None
    valid = (ids >= 0).repeat_interleave(md.block_size)
    return ids.clamp(min=0), valid


def decode_context_layout(md: AttentionMetadata, window: int | None,
                          sink_tokens: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """For the decode rows (the first md.num_decodes): the block ids covering the longest context,
    (num_decodes, num_blocks) int64, and which of those num_blocks * block_size positions each row
    may attend, (num_decodes, ctx) bool: before its seq_len and, with a window, within it or among
    the sinks. Built once per step and shared by every layer."""
    key = ("decode_context_layout", window, sink_tokens)
    if key not in md.backend_data:
        seq_lens = md.seq_lens[:md.num_decodes]
        max_len = max(md.seq_lens_cpu[:md.num_decodes])
        num_blocks = -(-max_len // md.block_size)
        block_ids = md.block_tables[:md.num_decodes, :num_blocks].to(torch.int64)
        pos = torch.arange(num_blocks * md.block_size, device=seq_lens.device)
        visible = pos[None, :] < seq_lens[:, None]
        if md.has_dropped_blocks:  # -1 entries: read block 0 in their place, never attended
            visible &= (block_ids >= 0).repeat_interleave(md.block_size, dim=1)
            block_ids = block_ids.clamp(min=0)
        if window is not None:
            visible &= (pos[None, :] > (seq_lens[:, None] - 1 - window)) | (pos[None, :] < sink_tokens)
        md.backend_data[key] = (block_ids, visible)
    return md.backend_data[key]


def soft_cap_scores(scores: torch.Tensor, cap: float | None) -> torch.Tensor:
    """cap * tanh(scores / cap) in place (scores already scaled), or scores unchanged without a cap."""
    if cap is None:
        return scores
    return scores.div_(cap).tanh_().mul_(cap)


def softmax_with_sinks(scores: torch.Tensor, sink_logits: torch.Tensor | None) -> torch.Tensor:
    """softmax over the last dim of `scores`, each row's denominator also holding exp(its sink logit):
    `sink_logits` broadcasts to scores.shape[:-1] + (1,). The sink is one more column of the softmax,
    dropped after it. Without sinks: the plain softmax."""
    if sink_logits is None:
        return scores.softmax(dim=-1)
    column = sink_logits.to(scores.dtype).expand(*scores.shape[:-1], 1)
    return torch.cat([scores, column], dim=-1).softmax(dim=-1)[..., :-1]


def attend_sdpa(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor | None,
                scale: float, logits_soft_cap: float | None = None,
                sink_logits: torch.Tensor | None = None) -> torch.Tensor:
    """SDPA over (B, H, Lq, D) queries and (B, H_kv, Lk, D) keys and values, `mask` (Lq, Lk) bool
    or None for plain causal attention. With a soft cap or sink logits (H,), which SDPA cannot
    apply, the scores are computed explicitly in float32: scale, cap, mask, softmax (with the
    sinks in its denominator), then the weighted values."""
    num_heads, num_kv_heads = query.shape[1], key.shape[1]
    if logits_soft_cap is None and sink_logits is None:
        return F.scaled_dot_product_attention(query, key, value, attn_mask=mask, is_causal=mask is None,
                                              scale=scale, enable_gqa=num_heads != num_kv_heads)
    if num_heads != num_kv_heads:
        key = key.repeat_interleave(num_heads // num_kv_heads, dim=1)
        value = value.repeat_interleave(num_heads // num_kv_heads, dim=1)
    scores = soft_cap_scores(torch.matmul(query.float(), key.float().transpose(-1, -2)).mul_(scale), logits_soft_cap)
    if mask is None:
        mask = torch.ones(scores.shape[-2:], dtype=torch.bool, device=scores.device).tril_()
    sinks = None if sink_logits is None else sink_logits.float().view(1, num_heads, 1, 1)
    probs = softmax_with_sinks(scores.masked_fill_(~mask, float("-inf")), sinks)
    return torch.matmul(probs.to(value.dtype), value)
