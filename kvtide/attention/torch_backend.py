"""The PyTorch backend: head-major paged cache, decode as two batched matmuls. The pure-torch
fallback of the CPU backend (cpu_backend.py), and usable on any device.

    kv_cache: (2, num_kv_heads, num_blocks, block_size, head_dim)

    decode:  blocks gathered along dim 2 with one index_select -> (2, H_kv, rows, ctx, D), where
             each (ctx, D) matrix is contiguous and (H_kv, rows) merge into one bmm batch with no
             further copy. (SDPA on the reference layout needs the gather plus a transpose copy,
             and its flash kernel is built for query blocks, not one query per request.) The
             contexts are gathered a few rows at a time (GATHER_CHUNK_BYTES), each chunk attended
             while it is still in cache: gathering a whole large batch at once writes a copy of
             every context to memory and reads it back.
    prefill: a chunk without cached prefix attends its own fresh K/V (no gather at all); a chunk
             with one gathers its request's blocks, already in SDPA's (H_kv, ctx, D) layout.

A quantized cache (kv_compression/formats.py) is gathered as bytes and dequantized per chunk of
rows, and prefills attend the dequantized cache too (never this step's unquantized K/V), so a
token's attention is the same whether its context was computed this step or hit in the prefix cache.

Checked against torch_ref.py on random mixed batches in tests/attention.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kvtide.attention.backend import (
    AttentionBackend,
    AttentionMetadata,
    attend_sdpa,
    decode_context_layout,
    prefill_mask,
    request_blocks,
    soft_cap_scores,
)

SOFTMAX_CUTOFF = 64.0
"""Decode keys scoring more than this below their row's best get weight exactly 0. Their true
weight (< e^-64 ~ 1.6e-28) is invisible in a float32 result, but softmax would return it as a
subnormal float, and x86 cores multiply subnormals through slow microcode assists: on the bench
model P @ V ran over 2x slower for it (see `softmax_without_subnormals`)."""
GATHER_CHUNK_BYTES = 8 << 20
"""Contexts gathered at once on the chunked decode path: small enough to stay in cache."""


class TorchAttentionBackend(AttentionBackend):
    name = "torch"

    def float_cache_shape(self, num_blocks: int, block_size: int, num_kv_heads: int,
                          head_dim: int) -> tuple[int, ...]:
        return (2, num_kv_heads, num_blocks, block_size, head_dim)

    def copy_float_blocks(self, kv_cache: torch.Tensor, src: torch.Tensor, dst: torch.Tensor) -> None:
        kv_cache[:, :, dst] = kv_cache[:, :, src]

    def write_kv(self, key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor,
                 slot_mapping: torch.Tensor, kv_scale: torch.Tensor | None = None) -> None:
        if self.kv_quant is not None:
            assert kv_scale is not None, "a quantized KV cache needs the layer's kv_scale"
            self.kv_quant.write(key, value, kv_cache, slot_mapping, kv_scale)
            return
        _, num_kv_heads, _, _, head_dim = kv_cache.shape
        # (H_kv, num_slots, D) views; key (T, H_kv, D) enters as (H_kv, T, D).
        for i, x in enumerate((key, value)):
            kv_cache[i].view(num_kv_heads, -1, head_dim).index_copy_(1, slot_mapping,
                                                                     x.transpose(0, 1).to(kv_cache.dtype))

    def forward(self, query: torch.Tensor, kv_cache: torch.Tensor, metadata: AttentionMetadata,
                scale: float, sliding_window: int | None, key: torch.Tensor | None = None,
                value: torch.Tensor | None = None, *, sink_tokens: int = 0,
                kv_scale: torch.Tensor | None = None, logits_soft_cap: float | None = None,
                sink_logits: torch.Tensor | None = None) -> torch.Tensor:
        num_decodes = metadata.num_decodes
        if num_decodes == metadata.num_reqs:
            return self._decode(query, kv_cache, metadata, scale, sliding_window, sink_tokens, kv_scale,
                                logits_soft_cap, sink_logits)
        output = torch.empty_like(query)
        if num_decodes:
            output[:num_decodes] = self._decode(query[:num_decodes], kv_cache, metadata, scale, sliding_window,
                                                sink_tokens, kv_scale, logits_soft_cap, sink_logits)
        self._prefill(output, query, kv_cache, metadata, range(num_decodes, metadata.num_reqs), scale,
                      sliding_window, key, value, sink_tokens, kv_scale, logits_soft_cap, sink_logits)
        return output

    def _prefill(self, output: torch.Tensor, query: torch.Tensor, kv_cache: torch.Tensor,
                 md: AttentionMetadata, rows: range | list[int], scale: float, window: int | None,
                 key: torch.Tensor | None, value: torch.Tensor | None, sink_tokens: int = 0,
                 kv_scale: torch.Tensor | None = None, logits_soft_cap: float | None = None,
                 sink_logits: torch.Tensor | None = None) -> None:
        """Attends the prefill rows `rows` (ascending) into their tokens of output."""
        if self.kv_quant is not None:
            key = value = None  # attend what the cache holds
        qsl = md.query_start_loc_cpu
        for first, last in self._prefill_runs(md, key is not None and value is not None, rows):
            start, end = qsl[first], qsl[last + 1]
            fresh = None if key is None or value is None else (key[start:end], value[start:end])
            if last > first:
                output[start:end] = self._prefill_run(query[start:end], fresh, last - first + 1, scale,  # type: ignore[arg-type]
                                                      window, sink_tokens, logits_soft_cap, sink_logits)
            else:
                output[start:end] = self._prefill_one(query[start:end], kv_cache, md, first, scale, window, fresh,
                                                      sink_tokens, kv_scale, logits_soft_cap, sink_logits)

    @staticmethod
    def _prefill_runs(md: AttentionMetadata, have_fresh: bool,
                      rows: range | list[int] | None = None) -> list[tuple[int, int]]:
        """Prefill requests (`rows`, default all) as runs [first, last] of neighbours that can share
        one SDPA call: same length and no cached prefix (their K/V are this step's, packed back to
        back). Any other request is a run of one."""
        qsl, seq_lens = md.query_start_loc_cpu, md.seq_lens_cpu
        runs: list[tuple[int, int]] = []
        for i in (range(md.num_decodes, md.num_reqs) if rows is None else rows):
            q_len = qsl[i + 1] - qsl[i]
            batchable = have_fresh and seq_lens[i] == q_len
            if runs and batchable and runs[-1][1] == i - 1:
                first = runs[-1][0]
                if seq_lens[first] == qsl[first + 1] - qsl[first] == q_len:
                    runs[-1] = (first, i)
                    continue
            runs.append((i, i))
        return runs

    @staticmethod
    def _prefill_run(query: torch.Tensor, fresh: tuple[torch.Tensor, torch.Tensor], num: int, scale: float,
                     window: int | None, sink_tokens: int = 0,
                     logits_soft_cap: float | None = None, sink_logits: torch.Tensor | None = None) -> torch.Tensor:
        """`num` uncached prompts of equal length L in one causal SDPA over (num, H, L, D) views."""
        total, num_heads, head_dim = query.shape
        q_len = total // num
        key, value = fresh
        num_kv_heads = key.shape[1]
        mask = prefill_mask(q_len, q_len, window, query.device, sink_tokens)
        out = attend_sdpa(query.view(num, q_len, num_heads, head_dim).transpose(1, 2),
                          key.view(num, q_len, num_kv_heads, head_dim).transpose(1, 2),
                          value.view(num, q_len, num_kv_heads, head_dim).transpose(1, 2),
                          mask, scale, logits_soft_cap, sink_logits)
        return out.transpose(1, 2).reshape(total, num_heads, head_dim)

    # ---- decodes -----------------------------------------------------------------------------
    def _decode(self, query: torch.Tensor, kv_cache: torch.Tensor, md: AttentionMetadata,
                scale: float, window: int | None, sink_tokens: int = 0,
                kv_scale: torch.Tensor | None = None, logits_soft_cap: float | None = None,
                sink_logits: torch.Tensor | None = None) -> torch.Tensor:
        num_decodes, num_heads, head_dim = query.shape
        num_kv_heads = kv_cache.shape[0 if self.kv_quant is not None else 1]
        block_ids, bias = self._decode_layout(md, window, sink_tokens)
        group = num_heads // num_kv_heads
        # Gathered contexts come head-major: (H_kv, rows, ctx, D) each, queries (H_kv, rows, group, D).
        q = (query * scale).view(num_decodes, num_kv_heads, group, head_dim).transpose(0, 1)
        out = torch.empty_like(q)
        # query head h = kv_head * group + g, as in q's view: (H_kv, 1, group, 1) against the scores
        sinks = None if sink_logits is None else sink_logits.float().view(num_kv_heads, 1, group, 1)
        row_bytes = 2 * num_kv_heads * block_ids.shape[1] * md.block_size * head_dim * query.element_size()
        rows = max(1, GATHER_CHUNK_BYTES // row_bytes)
        for first in range(0, num_decodes, rows):
            chunk = slice(first, first + rows)
            key, value = self._gather(kv_cache, block_ids[chunk], head_dim, kv_scale, query.dtype)
            out[:, chunk] = _attend(q[:, chunk], key.transpose(-1, -2), value, bias[chunk], logits_soft_cap, sinks)
        return out.transpose(0, 1).reshape(num_decodes, num_heads, head_dim)

    def _gather(self, kv_cache: torch.Tensor, block_ids: torch.Tensor, head_dim: int,
                kv_scale: torch.Tensor | None, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """(num_rows, num_blocks) block ids -> K, V (H_kv, num_rows, num_blocks * block_size, D) in `dtype`."""
        num_rows, num_blocks = block_ids.shape
        if self.kv_quant is not None:
            assert kv_scale is not None, "a quantized KV cache needs the layer's kv_scale"
            num_kv_heads = kv_cache.shape[0]
            key, value = self.kv_quant.read_blocks(kv_cache.index_select(1, block_ids.flatten()), head_dim,
                                                   kv_scale, dtype)
            return key.view(num_kv_heads, num_rows, -1, head_dim), value.view(num_kv_heads, num_rows, -1, head_dim)
        _, num_kv_heads, num_blocks_total, block_size, _ = kv_cache.shape
        # As 3-D (2 * H_kv, blocks, block_size * D), index_select takes its fast row-copy path.
        kv = kv_cache.view(2 * num_kv_heads, num_blocks_total, block_size * head_dim)
        kv = kv.index_select(1, block_ids.flatten())
        kv = kv.view(2, num_kv_heads, num_rows, num_blocks * block_size, head_dim).to(dtype)
        return kv[0], kv[1]

    def gather_float_blocks(self, kv_cache: torch.Tensor, block_ids: torch.Tensor, head_dim: int,
                            dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        key, value = self._gather(kv_cache, block_ids[None], head_dim, None, dtype)  # (H_kv, 1, N * B, D)
        return key[:, 0].transpose(0, 1), value[:, 0].transpose(0, 1)

    @staticmethod
    def _decode_layout(md: AttentionMetadata, window: int | None,
                       sink_tokens: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        """Block ids covering the longest decode context, and an additive (num_decodes, 1, ctx)
        float32 mask: 0 where a key is visible, -inf past the sequence or outside the window and
        the sinks. Built once per step and shared by every layer."""
        cache_key = ("torch_decode_bias", window, sink_tokens)
        if cache_key not in md.backend_data:
            block_ids, visible = decode_context_layout(md, window, sink_tokens)
            bias = torch.zeros(visible.shape, dtype=torch.float32, device=visible.device)
            bias.masked_fill_(~visible, float("-inf"))
            md.backend_data[cache_key] = (block_ids, bias[:, None, :])
        return md.backend_data[cache_key]

    # ---- prefill chunks ----------------------------------------------------------------------
    def _prefill_one(self, query: torch.Tensor, kv_cache: torch.Tensor, md: AttentionMetadata, i: int,
                     scale: float, window: int | None,
                     fresh: tuple[torch.Tensor, torch.Tensor] | None, sink_tokens: int = 0,
                     kv_scale: torch.Tensor | None = None, logits_soft_cap: float | None = None,
                     sink_logits: torch.Tensor | None = None) -> torch.Tensor:
        q_len, num_heads, head_dim = query.shape
        seq_len = md.seq_lens_cpu[i]
        key_valid = None
        if fresh is not None and seq_len == q_len:
            key, value = fresh[0].transpose(0, 1), fresh[1].transpose(0, 1)  # (H_kv, q_len, D)
        else:
            block_ids, key_valid = request_blocks(md, i, -(-seq_len // md.block_size))
            key, value = self._gather(kv_cache, block_ids[None], head_dim, kv_scale, query.dtype)
            key, value = key[:, 0, :seq_len], value[:, 0, :seq_len]
        mask = prefill_mask(q_len, seq_len, window, query.device, sink_tokens, key_valid)
        out = attend_sdpa(query.transpose(0, 1).unsqueeze(0), key.unsqueeze(0), value.unsqueeze(0), mask, scale,
                          logits_soft_cap, sink_logits)
        return out.squeeze(0).transpose(0, 1)


def softmax_without_subnormals(scores: torch.Tensor, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """softmax over the last dim of a fresh float32 tensor (modified in place), with weights below
    e^-SOFTMAX_CUTOFF of the row's largest set to exactly 0 instead of left subnormal. `sinks`
    (broadcast to scores.shape[:-1] + (1,)): one more logit per row in the denominator, dropped after."""
    if sinks is not None:
        scores = torch.cat([scores, sinks.expand(*scores.shape[:-1], 1)], dim=-1)
    scores -= scores.amax(dim=-1, keepdim=True)
    F.threshold_(scores, -SOFTMAX_CUTOFF, float("-inf"))  # x <= -cutoff -> -inf, in one pass
    probs = scores.softmax(dim=-1)
    return probs if sinks is None else probs[..., :-1]


def _attend(q: torch.Tensor, keys_t: torch.Tensor, values: torch.Tensor, bias: torch.Tensor,
            logits_soft_cap: float | None = None, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """q (H_kv, rows, group, D) already scaled, keys_t (H_kv, rows, D, ctx), values (H_kv, rows, ctx,
    D), bias broadcastable to (H_kv, rows, group, ctx) -> (H_kv, rows, group, D). A soft cap bends
    the scaled scores before the mask is added; `sinks` (H_kv, 1, group, 1) float32 join the softmax
    denominators."""
    scores = soft_cap_scores(torch.matmul(q, keys_t).float(), logits_soft_cap)  # (B1, B2, group, ctx), fresh
    probs = softmax_without_subnormals(scores + bias, sinks).to(q.dtype)
    return torch.matmul(probs, values)
