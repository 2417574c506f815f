"""The score drop policy's attention mass (score_dropping.py), measured in plain torch beside the
backend's attention: the compiled kernels do not export their weights, so the policy costs one more
attention pass per layer over the step's queries."""

from __future__ import annotations

import torch

from kvtide.attention.backend import (
    AttentionMetadata,
    prefill_mask,
    request_blocks,
    soft_cap_scores,
    softmax_with_sinks,
)


def accumulate_attention_mass(acc: torch.Tensor, query: torch.Tensor, kv_cache: torch.Tensor,
                              md: AttentionMetadata, backend, scale: float, window: int | None,
                              sink_tokens: int, kv_scale: torch.Tensor | None, *,
                              logits_soft_cap: float | None = None,
                              sink_logits: torch.Tensor | None = None) -> None:
    """Add one layer's attention mass per (request row, block) into acc (num_reqs, max_blocks), the
    step's AttentionMetadata.attention_mass: the softmax weights each key received from this step's
    queries, summed over heads and queries, under exactly the mask the backend attended with
    (causal, window and sinks, dropped blocks), and the denominators the sink logits join."""
    qsl, seq_lens = md.query_start_loc_cpu, md.seq_lens_cpu
    head_dim = query.shape[-1]
    for row in range(md.num_reqs):
        start, end, seq_len = qsl[row], qsl[row + 1], seq_lens[row]
        num_blocks = -(-seq_len // md.block_size)
        block_ids, key_valid = request_blocks(md, row, num_blocks)
        key, _ = backend.gather_blocks(kv_cache, block_ids, head_dim, kv_scale, torch.float32)
        key = key[:seq_len]
        q = query[start:end].float()
        group = q.shape[1] // key.shape[1]
        scores = soft_cap_scores(torch.einsum("qhd,khd->hqk", q, key.repeat_interleave(group, dim=1)) * scale,
                                 logits_soft_cap)
        mask = prefill_mask(end - start, seq_len, window, query.device, sink_tokens, key_valid)
        if mask is None:  # plain causal over a context that is all this step's
            mask = torch.ones(end - start, seq_len, dtype=torch.bool, device=query.device).tril_()
        sinks = None if sink_logits is None else sink_logits.float().view(-1, 1, 1)
        probs = softmax_with_sinks(scores.masked_fill_(~mask, float("-inf")), sinks)
        mass = probs.sum(dim=(0, 1))
        padded = torch.zeros(num_blocks * md.block_size, device=mass.device)
        padded[:seq_len] = mass
        acc[row, :num_blocks] += padded.view(num_blocks, md.block_size).sum(dim=-1)
