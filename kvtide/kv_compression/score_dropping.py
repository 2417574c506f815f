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

The choice is pure Python (the KV cache manager makes it); the mass is measured by the attention
layers (attention_mass.py).
"""

from __future__ import annotations

import math

MIN_KEPT_BLOCKS = 2
"""The sink block and the block being written."""


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
    candidates = sorted((b for b in live_ids if b not in protected),
                        key=lambda b: (mass[b] if b < len(mass) else 0.0, b))
    return sorted(candidates[:excess])
