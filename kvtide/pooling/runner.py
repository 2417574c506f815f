"""The model runner's pooling hook: after a pooling model's forward pass, pool each request whose
prompt this step finishes, run the model's head over them in one batch, and post-process per
request. Requests still mid-prompt (chunked prefill) only update their carried state.

The model declares `pooling_head(pooled) -> float32` (identity for embedders, the `score` layer of
a classifier); nothing here looks at its type.
"""

from __future__ import annotations

import torch

from kvtide.pooling.config import PoolerConfig
from kvtide.pooling.params import PoolingParams
from kvtide.pooling.poolers import PooledState, finish, pool_chunk


class PoolingRunner:
    def __init__(self, model: torch.nn.Module, config: PoolerConfig) -> None:
        if not hasattr(model, "pooling_head"):
            raise ValueError(f"{type(model).__name__} is not a pooling model (it has no pooling head)")
        self.model = model
        self.config = config
        self.states: dict[str, PooledState] = {}
        """Requests part-way through their prompt -> what their pooler carried so far."""
        self.num_pooled = 0
        """Requests pooled since start (a counter for tests and metrics)."""

    def forget(self, request_ids: set[str]) -> None:
        """Finished or preempted requests (a preempted one computes its prompt again from the start)."""
        for request_id in request_ids:
            self.states.pop(request_id, None)

    def pool(self, order: list[str], query_start_loc: list[int], hidden: torch.Tensor,
             starts: list[int], num_prompt_tokens: list[int],
             params: list[PoolingParams | None]) -> dict[str, list[float]]:
        """order: the step's request ids in batch order; query_start_loc (num_reqs + 1,) their rows
        in `hidden` (T, hidden); starts: each request's first prompt position this step. Returns
        request id -> its output, for the requests whose prompt ends in this step."""
        done: list[tuple[str, torch.Tensor, PoolingParams]] = []
        pooling_type = self.config.pooling_type
        for i, request_id in enumerate(order):
            rows = hidden[query_start_loc[i]:query_start_loc[i + 1]]
            state = self.states.setdefault(request_id, PooledState())
            pooled = pool_chunk(pooling_type, rows, starts[i], num_prompt_tokens[i], state)
            if pooled is not None:
                self.states.pop(request_id, None)
                done.append((request_id, pooled, params[i] or PoolingParams(task=self.config.task)))
        if not done:
            return {}
        heads = self.model.pooling_head(torch.stack([p.to(hidden.dtype) for _, p, _ in done]))  # (R, out)
        self.num_pooled += len(done)
        return {request_id: finish(heads[r], p, self.config) for r, (request_id, _, p) in enumerate(done)}
