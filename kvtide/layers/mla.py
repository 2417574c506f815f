"""Multi-head latent attention (DeepSeek-V2/V3) over a latent paged KV cache.

Per token the cache holds one vector shared by every head, the normed KV latent and the rotated
rope key, instead of H heads of expanded K and V:

    kv_cache: (num_blocks, block_size, kv_lora_rank + qk_rope_head_dim)
              slot = block_id * block_size + offset
              [ kv_c_normed (L) | k_pe (R) ]                 DeepSeek-V3: 512 + 64 = 576 values
              vs expanded H * ((qk_nope + R) + v_head)       DeepSeek-V3: 128 * (192 + 128) = 40960

kv_b_proj (weight (H * (qk_nope + v_head), L), rows head-major: per head its qk_nope k_nope rows,
then its v_head value rows) maps a latent to the head's k_nope and value. Two equal ways to attend:

    expanded:  k_nope, v = kv_b_proj(latent) per context token; key = [k_nope | k_pe];
               query = [q_nope | q_pe]; SDPA over H heads. Costs L * (qk_nope + v) per head per
               context token, so it suits long query chunks over short contexts (prefills).
    absorbed:  q_nope . k_nope = (q_nope W_UK) . latent, so the query is taken into latent space,
               [q_nope W_UK | q_pe] (H, L + R), and attends the cached vectors directly as one
               shared key/value head (MQA): out = (softmax(q . ctx^T * scale) ctx[:, :L]) W_UV^T.
               Nothing per context token but the dot products: the path for decodes and for short
               query rows over a long cached context (speculative-decode verification).

W_UK (H, qk_nope, L) and W_UV (H, v_head, L) are views of kv_b_proj.weight, read at each forward
(after loading; never copied). The model computes q_nope, the rotated q_pe, the normed latent and
the rotated k_pe, calls MLAAttention, then o_proj.

Under tensor parallelism H is this rank's heads (num_heads / tp, kv_b_proj column-parallel by
heads, so its local rows are those heads' and W_UK / W_UV view them), while the cache is the whole
latent on every rank: it is shared by all heads, so it is not divided (vLLM keeps it whole too).
"""

from __future__ import annotations

import math
from typing import Literal

import torch
import torch.nn.functional as F
from torch import nn

from kvtide.attention.backend import AttentionMetadata, decode_context_layout, prefill_mask, request_blocks
from kvtide.attention.torch_backend import softmax_without_subnormals

GATHER_CHUNK_BYTES = 16 << 20
"""Decode rows gathered and attended at once (their latent contexts plus float32 scores): small
enough to stay in cache, as in torch_backend.py."""

AttentionPath = Literal["auto", "absorbed", "expanded"]


def yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    """DeepSeek's yarn_get_mscale: the attention temperature YaRN applies at context factor `scale`."""
    if scale <= 1:
        return 1.0
    return 0.1 * mscale * math.log(scale) + 1.0


def mla_softmax_scale(hf_config) -> float:
    """The softmax scale HF's DeepseekV2/V3 attention uses (`self.scaling`): qk_head_dim^-0.5, times
    mscale^2 when the rope scaling is not default and sets `mscale_all_dim` (YaRN checkpoints)."""
    from kvtide.layers.rotary import rope_parameters

    qk_head_dim = hf_config.qk_nope_head_dim + hf_config.qk_rope_head_dim
    scaling = qk_head_dim ** -0.5
    params = rope_parameters(hf_config)
    if params.get("rope_type", "default") != "default":
        mscale_all_dim = params.get("mscale_all_dim", 0)
        if mscale_all_dim:
            mscale = yarn_mscale(params["factor"], mscale_all_dim)
            scaling = scaling * mscale * mscale
    return scaling


class MLAAttention(nn.Module):
    """Attention over a latent paged cache: per token one vector [kv_c_normed (kv_lora_rank) | k_pe (qk_rope_head_dim)]."""

    def __init__(self, num_heads: int, qk_nope_head_dim: int, qk_rope_head_dim: int, v_head_dim: int,
                 kv_lora_rank: int, scale: float, kv_b_proj: nn.Module,
                 absorb_max_query_len: int | None = None) -> None:
        super().__init__()
        rows = getattr(kv_b_proj, "output_size", getattr(kv_b_proj, "out_features", None))
        if rows is not None and rows != num_heads * (qk_nope_head_dim + v_head_dim):
            raise ValueError(f"kv_b_proj has {rows} output rows here; {num_heads} heads of qk_nope "
                             f"{qk_nope_head_dim} + v_head {v_head_dim} need {num_heads * (qk_nope_head_dim + v_head_dim)} "
                             f"(under tensor parallelism, pass this rank's heads)")
        self.num_heads = num_heads
        """This rank's heads (num_attention_heads / tp)."""
        self.qk_nope_head_dim = qk_nope_head_dim
        self.qk_rope_head_dim = qk_rope_head_dim
        self.v_head_dim = v_head_dim
        self.kv_lora_rank = kv_lora_rank
        self.scale = scale
        self.num_kv_heads = 1
        self.head_dim = kv_lora_rank + qk_rope_head_dim
        """Values per cached token (the latent vector), what the runner's accounting reads: the
        same on every tensor-parallel rank."""
        self.sliding_window = None
        self.sink_tokens = 0
        self.kv_cache: torch.Tensor | None = None
        """Bound by the model runner: (num_blocks, block_size, head_dim) in the model dtype."""
        self.backend = None
        """Set by the runner like any attention layer's; MLA attends itself and never reads it."""
        self.calculate_kv_scales = False
        self.register_buffer("kv_scale", torch.ones(2, dtype=torch.float32), persistent=False)
        # Held outside nn.Module registration: the model owns kv_b_proj (its parameter names and
        # loading); registering it here too would give the weight a second name.
        self._kv_b_proj = (kv_b_proj,)
        if absorb_max_query_len is None:
            absorb_max_query_len = _absorb_crossover(kv_lora_rank, qk_nope_head_dim, v_head_dim)
        self.absorb_max_query_len = absorb_max_query_len
        """A non-decode row with a cached prefix and at most this many query tokens takes the absorbed
        path (default: where its cost per context token drops below the expansion's)."""

    @property
    def kv_b_proj(self) -> nn.Module:
        return self._kv_b_proj[0]

    # ---- cache layout and accounting ----------------------------------------------------------
    def cache_shape(self, num_blocks: int, block_size: int) -> tuple[int, ...]:
        """(num_blocks, block_size, kv_lora_rank + qk_rope_head_dim)."""
        return (num_blocks, block_size, self.head_dim)

    def kv_bytes_per_token(self, dtype: torch.dtype) -> int:
        return self.head_dim * torch.empty((), dtype=dtype).element_size()

    def expanded_kv_bytes_per_token(self, dtype: torch.dtype) -> int:
        """What H heads of expanded K (qk_nope + qk_rope) and V (v_head) would take, for reporting."""
        per_head = self.qk_nope_head_dim + self.qk_rope_head_dim + self.v_head_dim
        return self.num_heads * per_head * torch.empty((), dtype=dtype).element_size()

    @staticmethod
    def copy_blocks(kv_cache: torch.Tensor, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Copy whole blocks src[i] -> dst[i] (copy-on-write after a fork)."""
        kv_cache[dst] = kv_cache[src]

    # ---- forward ------------------------------------------------------------------------------
    def forward(self, q_nope: torch.Tensor, q_pe: torch.Tensor, kv_c_normed: torch.Tensor, k_pe: torch.Tensor,
                metadata: AttentionMetadata, *, path: AttentionPath = "auto") -> torch.Tensor:
        """q_nope (T, H, qk_nope), q_pe (T, H, qk_rope) rotated, kv_c_normed (T, kv_lora_rank), k_pe (T, qk_rope)
        rotated -> (T, H * v_head_dim). Writes [kv_c_normed | k_pe] into self.kv_cache at metadata.slot_mapping
        first, then attends each query to its request's cached context causally.

        `path` forces every row through one computation (tests); "auto": decodes and short rows over a
        cached prefix absorbed, other prefill chunks expanded."""
        assert self.kv_cache is not None, "KV cache not bound"
        if metadata.has_dropped_blocks:
            raise ValueError("MLA attention does not support dropped KV blocks (the KV drop policy)")
        num_tokens = q_nope.shape[0]
        latent = torch.cat((kv_c_normed, k_pe), dim=-1).to(self.kv_cache.dtype)  # (T, L + R)
        self.kv_cache.view(-1, self.head_dim).index_copy_(0, metadata.slot_mapping, latent)

        qsl = metadata.query_start_loc_cpu
        alloc = torch.empty if qsl[-1] == num_tokens else torch.zeros
        out = alloc(num_tokens, self.num_heads, self.v_head_dim, dtype=q_nope.dtype, device=q_nope.device)
        num_decodes = metadata.num_decodes if path != "expanded" else 0
        if num_decodes:
            out[:num_decodes] = self._absorbed_decodes(q_nope[:num_decodes], q_pe[:num_decodes], metadata)
        for row in range(num_decodes, metadata.num_reqs):
            start, end = qsl[row], qsl[row + 1]
            context = self._context(latent[start:end], metadata, row)
            attend = self._absorbed_row if self._absorbs(path, end - start, context.shape[0]) else self._expanded_row
            out[start:end] = attend(q_nope[start:end], q_pe[start:end], context)
        return out.view(num_tokens, self.num_heads * self.v_head_dim)

    def _absorbs(self, path: AttentionPath, q_len: int, seq_len: int) -> bool:
        """Whether a non-decode row of q_len queries ending a context of seq_len takes the absorbed path."""
        if path != "auto":
            return path == "absorbed"
        return seq_len > q_len and q_len <= self.absorb_max_query_len

    def _context(self, fresh: torch.Tensor, md: AttentionMetadata, row: int) -> torch.Tensor:
        """Row `row`'s latent context (seq_len, L + R): this step's latents when it has no cached
        prefix (exactly what was just written), else its blocks from the cache."""
        seq_len = md.seq_lens_cpu[row]
        if seq_len == fresh.shape[0]:
            return fresh
        assert self.kv_cache is not None
        block_ids, _ = request_blocks(md, row, -(-seq_len // md.block_size))
        return self.kv_cache.index_select(0, block_ids).view(-1, self.head_dim)[:seq_len]

    def _up_weights(self, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """W_UK (H, qk_nope, L) and W_UV (H, v_head, L): views of kv_b_proj.weight, whose rows are
        head-major, [k_nope rows | value rows] per head."""
        weight = getattr(self.kv_b_proj, "weight", None)
        if (getattr(self.kv_b_proj, "quantized", None) is not None or not isinstance(weight, torch.Tensor)
                or not weight.dtype.is_floating_point):
            raise NotImplementedError("MLA's absorbed attention needs kv_b_proj as a float weight (not quantized)")
        weight = weight.view(self.num_heads, self.qk_nope_head_dim + self.v_head_dim, self.kv_lora_rank)
        if weight.dtype != dtype:
            weight = weight.to(dtype)
        return weight[:, :self.qk_nope_head_dim], weight[:, self.qk_nope_head_dim:]

    # ---- absorbed: queries in latent space, one shared key/value head --------------------------
    def _absorb_query(self, q_nope: torch.Tensor, q_pe: torch.Tensor, w_uk: torch.Tensor) -> torch.Tensor:
        """q_nope (n, H, qk_nope), q_pe (n, H, R) -> [q_nope W_UK | q_pe] (n, H, L + R)."""
        q_latent = torch.bmm(q_nope.transpose(0, 1), w_uk)  # (H, n, L)
        return torch.cat((q_latent.transpose(0, 1), q_pe), dim=-1)

    @staticmethod
    def _unabsorb_output(out_latent: torch.Tensor, w_uv: torch.Tensor) -> torch.Tensor:
        """out_latent (n, H, L) -> through W_UV: (n, H, v_head)."""
        return torch.bmm(out_latent.transpose(0, 1), w_uv.transpose(1, 2)).transpose(0, 1)

    def _latent_attention(self, query: torch.Tensor, context: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
        """query (..., H, L + R), context (..., S, L + R) or (S, L + R), bias broadcastable to
        (..., H, S), 0 or -inf -> (..., H, L): the context's latents weighted by the softmax."""
        scores = torch.matmul(query, context.transpose(-1, -2))  # (..., H, S)
        scores = scores.float().mul_(self.scale).add_(bias)  # .float() of float32 scores is them: fresh
        probs = softmax_without_subnormals(scores).to(query.dtype)
        return torch.matmul(probs, context[..., :self.kv_lora_rank])

    def _absorbed_decodes(self, q_nope: torch.Tensor, q_pe: torch.Tensor, md: AttentionMetadata) -> torch.Tensor:
        """The decode rows (one query each) in one batched gather per chunk of rows -> (num_decodes, H, v_head)."""
        assert self.kv_cache is not None
        num_decodes = q_nope.shape[0]
        w_uk, w_uv = self._up_weights(q_nope.dtype)
        query = self._absorb_query(q_nope, q_pe, w_uk)  # (num_decodes, H, L + R)
        block_ids, bias = self._decode_layout(md)
        ctx_len = block_ids.shape[1] * md.block_size
        row_bytes = ctx_len * (self.head_dim * query.element_size() + 8 * self.num_heads)
        rows = max(1, GATHER_CHUNK_BYTES // row_bytes)
        out_latent = query.new_empty(num_decodes, self.num_heads, self.kv_lora_rank)
        for first in range(0, num_decodes, rows):
            chunk = slice(first, first + rows)
            ids = block_ids[chunk]
            context = self.kv_cache.index_select(0, ids.flatten()).view(ids.shape[0], ctx_len, self.head_dim)
            out_latent[chunk] = self._latent_attention(query[chunk], context.to(query.dtype), bias[chunk])
        return self._unabsorb_output(out_latent, w_uv)

    @staticmethod
    def _decode_layout(md: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        """Block ids covering the longest decode context and an additive (num_decodes, 1, ctx) float32
        mask, 0 before each row's seq_len, -inf after. Built once per step and shared by every layer."""
        cache_key = ("mla_decode_bias",)
        if cache_key not in md.backend_data:
            block_ids, visible = decode_context_layout(md, None)
            bias = torch.zeros(visible.shape, dtype=torch.float32, device=visible.device)
            bias.masked_fill_(~visible, float("-inf"))
            md.backend_data[cache_key] = (block_ids, bias[:, None, :])
        return md.backend_data[cache_key]

    def _absorbed_row(self, q_nope: torch.Tensor, q_pe: torch.Tensor, context: torch.Tensor) -> torch.Tensor:
        """One row's q_len queries over its latent context (seq_len, L + R), causally -> (q_len, H, v_head)."""
        q_len, seq_len = q_nope.shape[0], context.shape[0]
        w_uk, w_uv = self._up_weights(q_nope.dtype)
        query = self._absorb_query(q_nope, q_pe, w_uk)  # (q_len, H, L + R)
        bias = torch.zeros(q_len, seq_len, dtype=torch.float32, device=query.device)
        bias.masked_fill_(~_causal_mask(q_len, seq_len, query.device), float("-inf"))
        out_latent = self._latent_attention(query, context.to(query.dtype), bias[:, None, :])
        return self._unabsorb_output(out_latent, w_uv)

    # ---- expanded: per-head K and V from the latents, then SDPA -------------------------------
    def _expanded_row(self, q_nope: torch.Tensor, q_pe: torch.Tensor, context: torch.Tensor) -> torch.Tensor:
        """One row's q_len queries over its latent context (seq_len, L + R), causally -> (q_len, H, v_head)."""
        q_len, seq_len = q_nope.shape[0], context.shape[0]
        context = context.to(q_nope.dtype)
        kv = self.kv_b_proj(context[:, :self.kv_lora_rank].contiguous())
        kv = kv.view(seq_len, self.num_heads, self.qk_nope_head_dim + self.v_head_dim)
        k_nope, value = kv.split((self.qk_nope_head_dim, self.v_head_dim), dim=-1)
        k_pe = context[:, None, self.kv_lora_rank:].expand(seq_len, self.num_heads, self.qk_rope_head_dim)
        key = torch.cat((k_nope, k_pe), dim=-1)  # (S, H, qk_nope + R)
        query = torch.cat((q_nope, q_pe), dim=-1)  # (q_len, H, qk_nope + R)
        mask = prefill_mask(q_len, seq_len, None, query.device)
        out = F.scaled_dot_product_attention(  # value head dim may differ from the key's
            query.transpose(0, 1)[None], key.transpose(0, 1)[None], value.transpose(0, 1)[None],
            attn_mask=mask, is_causal=mask is None, scale=self.scale)
        return out[0].transpose(0, 1)


def _causal_mask(q_len: int, seq_len: int, device: torch.device) -> torch.Tensor:
    """(q_len, seq_len) bool: query i at position seq_len - q_len + i sees keys j <= it."""
    mask = prefill_mask(q_len, seq_len, None, device)
    if mask is None:  # seq_len == q_len: plain lower triangle
        mask = torch.ones(q_len, seq_len, dtype=torch.bool, device=device).tril()
    return mask


def _absorb_crossover(kv_lora_rank: int, qk_nope_head_dim: int, v_head_dim: int) -> int:
    """The largest query count for which absorbed attention over a long cached context is cheaper.

    Per head and context token, absorbed costs q * (2L + R) multiply-adds (scores over L + R,
    weighted latents over L); expanded costs L * (qk_nope + v) for the expansion plus
    q * (qk_nope + R + v) to attend: absorbed wins while q < L (qk_nope + v) / (2L - qk_nope - v).
    DeepSeek-V3 (L 512, qk_nope 128, v 128): 170.
    """
    denominator = 2 * kv_lora_rank - qk_nope_head_dim - v_head_dim
    if denominator <= 0:
        return 1 << 30
    return kv_lora_rank * (qk_nope_head_dim + v_head_dim) // denominator
