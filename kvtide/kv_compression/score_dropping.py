"""Score-based KV dropping (H2O's heavy hitters, at block granularity): keep a request within a
fraction F of its full KV by dropping the blocks that attention has used least.

    mass[b]   attention probability that keys of block b received, summed over every query the
              request computed (prompt and output tokens), every head and every layer
    full      blocks holding computed KV: ceil(num_computed_tokens / block_size)
    keep      max(MIN_KEPT_BLOCKS, ceil(F * full))

Before each step, while more than `keep` blocks are live, the live block with the least mass is
dropped, except block 0 (the first tokens, which attention keeps as a sink whatever they say) and
the most recent keep // 2 live blocks (H2O's split between recent tokens and heavy hitters; the
block being written is always among them). Ties go to the earlier block. A dropped block is freed
to the pool and masked exactly: no later query attends its keys, while its positions keep counting
(rotary embeddings and the causal order are those of the full sequence). Dropping whole blocks is
what frees memory in a paged cache; single tokens would leave every block partly in use.

The mass is computed by `accumulate_attention_mass` in plain torch beside the backend's attention
(the compiled kernels do not export their weights): the policy costs one more attention pass per
layer, and runs on the torch paths.
"""

from __future__ import annotations

import math

import torch

from kvtide.attention.backend import AttentionMetadata, prefill_mask, request_blocks

MIN_KEPT_BLOCKS = 2
"""The sink block and the block being written."""
MASS_KEY = "kv_block_mass"
"""AttentionMetadata.backend_data key of the step's (num_reqs, max_blocks) float32 mass accumulator."""


def blocks_to_drop(mass: list[float], live: list[bool], num_computed: int, block_size: int,
                   budget: float) -> list[int]:
    """Block indices to drop now (ascending) so that at most `keep` of the request's computed blocks
    stay live; `mass` and `live` are per block index (missing mass counts as 0)."""
    full = -(-num_computed // block_size)
    keep = max(MIN_KEPT_BLOCKS, math.ceil(budget * full))
    live_ids = [b for b in range(full) if live[b]]
    excess = len(live_ids) - keep
    if excess <= 0:
        return []
    protected = {0, *live_ids[-max(1, keep // 2):]}
    candidates = sorted((b for b in live_ids if b not in protected), key=lambda b: (mass[b] if b < len(mass) else 0.0, b))
    return sorted(candidates[:excess])


def accumulate_attention_mass(acc: torch.Tensor, query: torch.Tensor, kv_cache: torch.Tensor,
                              md: AttentionMetadata, backend, scale: float, window: int | None,
                              sink_tokens: int, kv_scale: torch.Tensor | None) -> None:
    """Add one layer's attention mass per (request row, block) into acc (num_reqs, max_blocks):
    the softmax weights each key received from this step's queries, summed over heads and queries,
    under exactly the mask the backend attended with (causal, window and sinks, dropped blocks)."""
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
        scores = torch.einsum("qhd,khd->hqk", q, key.repeat_interleave(group, dim=1)) * scale
        mask = prefill_mask(end - start, seq_len, window, query.device, sink_tokens, key_valid)
        if mask is None:
            mask = torch.ones(end - start, seq_len, dtype=torch.bool, device=query.device).tril_()
        probs = scores.masked_fill_(~mask, float("-inf")).softmax(dim=-1)
        mass = probs.sum(dim=(0, 1))
        padded = torch.zeros(num_blocks * md.block_size, device=mass.device)
        padded[:seq_len] = mass
        acc[row, :num_blocks] += padded.view(num_blocks, md.block_size).sum(dim=-1)
