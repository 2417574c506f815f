"""Pooling hidden states into one vector per prompt, chunk by chunk.

A causal model may compute a prompt over several steps (chunked prefill), so each pooler carries
what it needs across them in a PooledState:

    LAST:  nothing; the last chunk's last row
    MEAN:  a float32 running sum of every row so far; divided by the prompt length at the end
    CLS:   the first chunk's first row

and the finishing step's post-processing (`finish`) applies the request's task: Matryoshka cut and
L2 normalization for embeddings, softmax / sigmoid for class logits.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kvtide.pooling.config import PoolerConfig
from kvtide.pooling.params import PoolingParams


@dataclass
class PooledState:
    """What a request's pooler kept from its earlier chunks."""

    carried: torch.Tensor | None = None


def pool_chunk(pooling_type: str, rows: torch.Tensor, start: int, num_prompt_tokens: int,
               state: PooledState) -> torch.Tensor | None:
    """rows (n, hidden): the hidden states of prompt positions [start, start + n). Returns the
    pooled (hidden,) vector once the chunk reaches the prompt's end, else None (state updated)."""
    ends = start + rows.shape[0] >= num_prompt_tokens
    if pooling_type == "LAST":
        return rows[-1] if ends else None
    if pooling_type == "CLS":
        if start == 0:
            state.carried = rows[0]
        return state.carried if ends else None
    if pooling_type == "MEAN":
        total = rows.float().sum(dim=0)
        state.carried = total if state.carried is None else state.carried + total
        return state.carried / num_prompt_tokens if ends else None
    raise ValueError(f"unknown pooling type {pooling_type!r}")


def finish(head_output: torch.Tensor, params: PoolingParams, config: PoolerConfig) -> list[float]:
    """One request's head output (float32: an embedding or class logits) -> what it asked for."""
    x = head_output
    if params.task in ("embed", "encode"):
        dims = params.dimensions if params.dimensions is not None else config.dimensions
        if dims is not None:
            x = x[:dims]
        normalize = params.normalize if params.normalize is not None else config.normalize
        if params.task == "embed" and normalize:
            x = F.normalize(x, p=2, dim=-1)
        return x.tolist()
    activate = params.use_activation is not False
    if params.task == "score":
        # One label: its sigmoid; several: the probability of the last ("relevant") label.
        if x.shape[-1] == 1:
            return [float(torch.sigmoid(x[0])) if activate else float(x[0])]
        return [float(x.softmax(dim=-1)[-1]) if activate else float(x[-1])]
    if not activate:
        return x.tolist()
    return (torch.sigmoid(x) if x.shape[-1] == 1 else x.softmax(dim=-1)).tolist()
