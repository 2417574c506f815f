"""The runner's view of the requests it runs: each request's tokens and block table, kept across
steps, and one step's flat input tensors built from them."""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import numpy as np
import torch

from kvtide.attention.backend import AttentionMetadata
from kvtide.sampling.metadata import RowState
from kvtide.sampling_params import SamplingParams
from kvtide.worker.cuda_graph import to_device


@dataclass
class CachedRequestState:
    request_id: str
    token_ids: list[int]
    num_prompt_tokens: int
    sampling_params: SamplingParams
    block_ids: list[int]
    num_computed_tokens: int
    uid: int = 0
    """Fresh each time the runner (re)receives the request in full; see AttentionMetadata.row_uids."""

    def row_state(self) -> RowState:
        return RowState(self.sampling_params, self.token_ids[:self.num_prompt_tokens],
                        self.token_ids[self.num_prompt_tokens:])


@dataclass
class StepInputs:
    input_ids: torch.Tensor
    positions: torch.Tensor
    metadata: AttentionMetadata
    order: list[str]
    """Request ids in batch order (decodes first)."""
    sample_rows: list[int]
    """Indices into `order` of requests that sample a token this step."""
    logits_indices: torch.Tensor
    """Token indices whose logits the sampler reads: per sampling request its last token, and with
    drafts its last known token and every draft (one position per token it may emit)."""


def prepare_step_inputs(num_scheduled_tokens: dict[str, int], requests: dict[str, CachedRequestState],
                        block_size: int, device: torch.device,
                        drafts: dict[str, list[int]] | None = None, num_kv_groups: int = 1) -> StepInputs:
    """One step's flat tensors, decodes first. The index math runs in numpy over the whole batch
    (a numpy op costs a fraction of a torch op's dispatch, and this runs every step); only the
    token ids and block ids are gathered per request. A request with `drafts` computes them after
    its last token (counted in its scheduled tokens) and gets logits at each of those positions.
    With `num_kv_groups` > 1 the block ids interleave one table per layer group (kv_cache/hybrid.py)
    and each group gets its metadata (AttentionMetadata.groups).

        lens [1, 1, 3] at starts [7, 4, 0]  ->  positions [7, 4, 0, 1, 2]
        slot_mapping = block_tables[request of token, position // block_size] * block_size
                       + position % block_size
    """
    num_sched = num_scheduled_tokens
    order = sorted(num_sched, key=lambda r: num_sched[r] != 1)
    states = [requests[r] for r in order]
    lens = [num_sched[r] for r in order]
    starts = [state.num_computed_tokens for state in states]
    seq_lens = [start + n for start, n in zip(starts, lens, strict=True)]
    query_start_loc = list(itertools.accumulate(lens, initial=0))
    drafts = drafts or {}
    num_drafts = [len(drafts.get(r, ())) for r in order]
    sample_rows = [i for i, (state, end, d) in enumerate(zip(states, seq_lens, num_drafts, strict=True))
                   if end >= len(state.token_ids) + d]
    input_ids: list[int] = []
    for req_id, state, start, n, d in zip(order, states, starts, lens, num_drafts, strict=True):
        input_ids.extend(state.token_ids[start:start + n - d])
        if d:
            input_ids.extend(drafts[req_id])

    max_blocks = max(len(state.block_ids) for state in states)
    flat_tables = np.zeros((len(order), max_blocks), dtype=np.int32)
    for row, state in zip(flat_tables, states, strict=True):
        row[:len(state.block_ids)] = state.block_ids
    lens_np = np.array(lens, dtype=np.int64)
    token_req = np.repeat(np.arange(len(order)), lens_np)
    # position of token t = t - (first token index of its request) + its request's start
    offsets = np.array(starts, dtype=np.int64) - np.array(query_start_loc[:-1], dtype=np.int64)
    positions = np.arange(query_start_loc[-1], dtype=np.int64) + offsets[token_req]
    shared = dict(
        num_reqs=len(order), num_decodes=lens.count(1), num_actual_tokens=len(input_ids),
        query_start_loc=to_device(torch.tensor(query_start_loc, dtype=torch.int32), device),
        seq_lens=to_device(torch.tensor(seq_lens, dtype=torch.int32), device),
        max_query_len=max(lens), max_seq_len=max(seq_lens), block_size=block_size,
        query_start_loc_cpu=query_start_loc, seq_lens_cpu=seq_lens, row_uids=[state.uid for state in states])

    def table_metadata(block_tables: np.ndarray) -> AttentionMetadata:
        slot_mapping = block_tables[token_req, positions // block_size].astype(np.int64) * block_size \
            + positions % block_size
        return AttentionMetadata(block_tables=to_device(torch.from_numpy(block_tables), device),
                                 slot_mapping=to_device(torch.from_numpy(slot_mapping), device),
                                 has_dropped_blocks=bool((block_tables < 0).any()), **shared)

    if num_kv_groups == 1:
        metadata = table_metadata(flat_tables)
    else:  # kv_cache/hybrid.py: group g's entries are every G-th of the flat table, from g
        # copy(), not ascontiguousarray: numpy calls a (1, 1) slice contiguous and keeps its stride
        groups = [table_metadata(flat_tables[:, g::num_kv_groups].copy()) for g in range(num_kv_groups)]
        metadata = groups[0]
        metadata.groups = groups
    logits_indices = torch.tensor([j for i in sample_rows
                                   for j in range(query_start_loc[i + 1] - 1 - num_drafts[i], query_start_loc[i + 1])],
                                  dtype=torch.int64)
    return StepInputs(to_device(torch.tensor(input_ids, dtype=torch.int64), device),
                      to_device(torch.from_numpy(positions), device), metadata, order, sample_rows,
                      to_device(logits_indices, device))
