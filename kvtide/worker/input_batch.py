"""The runner's view of the requests it runs: each request's tokens and block table, kept across
steps in preallocated rows (InputBatch), and one step's flat input tensors gathered from them.

`prepare_step_inputs` builds a step from scratch out of per-request records: the draft proposers'
own passes use it, and it is the reference the persistent batch is tested against."""

from __future__ import annotations

import itertools
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch

from kvtide.attention.backend import AttentionMetadata
from kvtide.lora.request import LoRARequest
from kvtide.pooling.params import PoolingParams
from kvtide.sampling.metadata import RowState, SamplingMetadata, SamplingRowTable
from kvtide.sampling_params import SamplingParams
from kvtide.scheduler.output import CachedRequestData, SchedulerOutput
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
    lora_request: LoRARequest | None = None
    """The LoRA adapter the request runs with (None: the base model)."""
    pooling_params: PoolingParams | None = None
    """A pooling request (kvtide/pooling/runner.py pools it instead of sampling)."""

    def row_state(self) -> RowState:
        return RowState(self.sampling_params, self.token_ids[:self.num_prompt_tokens],
                        self.token_ids[self.num_prompt_tokens:])

    # The sampler's row (sampling/metadata.py SamplingRow), read lazily: the token lists are sliced
    # only for the rows whose penalties need them.
    @property
    def params(self) -> SamplingParams:
        return self.sampling_params

    @property
    def prompt_token_ids(self) -> list[int]:
        return self.token_ids[:self.num_prompt_tokens]

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]


class RowListener(Protocol):
    """Told when a request takes a row (new, or resumed after preemption) and when it leaves one
    (finished, preempted): per-request state kept outside the rows follows the batch this way
    (logits_processors/batch.py)."""

    def request_added(self, state: CachedRequestState) -> None: ...

    def request_removed(self, request_id: str) -> None: ...


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
    batch_rows: np.ndarray | None = None
    """(num_reqs,) the InputBatch row of each request in `order`; None for a step built from scratch."""


class InputBatch:
    """Every request the runner holds, one row each, kept across steps: the scheduler sends a new
    request in full once and then only what changed (SchedulerOutput's diffs), and a step gathers
    its scheduled rows out of these arrays instead of rebuilding them from per-request lists.

        row r:  token_ids[r, :num_tokens[r]]            prompt, then output (drafts never land here)
                block_table[r, :num_blocks[r]]          block ids, -1 where the drop policy removed one,
                                                        0 past num_blocks (the padding a step's table has)
                num_computed_tokens[r], num_prompt_tokens[r], uids[r]
                lora_ids[r]                             the row's LoRA adapter id (0: the base model)
                sampling.*[r]                           the sampling parameters (SamplingRowTable)

    With KV layer groups (kv_cache/hybrid.py) a request's block ids interleave one table per group
    and are kept so; a step splits them per group. Rows of finished requests go back to a free list
    and are reused; arrays grow (doubling) when rows, tokens or blocks outgrow them.

    `requests` keeps each request's CachedRequestState in step with its row (token ids, block ids,
    computed tokens): the draft proposers, prompt logprobs, structured output and fault injection
    read those records, and they are the sampler's rows.

    Later per-request state plugs in here as more columns, written in `_add` and cleared in
    `_remove`, and gathered with the step's rows like `uids`: a LoRA adapter slot per row (the
    step's adapter mapping), a multimodal row's encoder inputs and their token positions, a grammar
    bitmask row (today the engine core masks through SchedulerOutput.grammar, by request id).
    """

    def __init__(self, block_size: int, vocab_size: int, device: torch.device, max_num_reqs: int = 8,
                 max_model_len: int = 2048) -> None:
        self.block_size = block_size
        self.device = device
        rows = max(max_num_reqs, 1)
        cols = min(max_model_len, 256)  # grown on demand: most requests stay far below max_model_len
        self.token_ids = np.zeros((rows, cols), dtype=np.int64)
        self.num_tokens = np.zeros(rows, dtype=np.int64)
        self.num_prompt_tokens = np.zeros(rows, dtype=np.int64)
        self.num_computed_tokens = np.zeros(rows, dtype=np.int64)
        self.block_table = np.zeros((rows, -(-cols // block_size)), dtype=np.int32)
        self.num_blocks = np.zeros(rows, dtype=np.int64)
        self.uids = np.zeros(rows, dtype=np.int64)
        self.lora_ids = np.zeros(rows, dtype=np.int64)
        self.lora_requests: dict[int, LoRARequest] = {}
        """lora_int_id -> its LoRARequest, for the ids in `lora_ids` (the adapter's files)."""
        self.sampling = SamplingRowTable(vocab_size, rows)
        self.requests: dict[str, CachedRequestState] = {}
        self.row_of: dict[str, int] = {}
        self._free_rows: list[int] = []
        self._num_rows = 0
        """Rows ever handed out (the high-water mark); rows below it not in use are in _free_rows."""
        self.row_listener: RowListener | None = None

    # ---- the diffs -------------------------------------------------------------------------------
    def update(self, so: SchedulerOutput, uids: Iterator[int], samples: bool = True) -> None:
        """Apply one step's diffs: finished (and preempted) requests leave, new ones (and preempted
        ones coming back: a fresh uid from `uids`) arrive in full, running ones get their new blocks,
        dropped blocks and tokens. `samples`: this rank samples (the last pipeline stage); earlier
        stages take the sampled tokens from the diffs."""
        for req_id in so.finished_req_ids:
            self._remove(req_id)
        for new in so.scheduled_new_reqs:
            self._remove(new.request_id)
            self._add(CachedRequestState(new.request_id, list(new.token_ids), new.num_prompt_tokens,
                                         new.sampling_params, list(new.block_ids), new.num_computed_tokens,
                                         uid=next(uids), lora_request=new.lora_request,
                                         pooling_params=new.pooling_params))
        if not so.scheduled_cached_reqs:
            return
        requests, row_of = self.requests, self.row_of
        rows, computed = [], []
        for cached in so.scheduled_cached_reqs:  # the common case, a decode, only moves num_computed_tokens
            req_id = cached.request_id
            state = requests[req_id]
            row = row_of[req_id]
            state.num_computed_tokens = cached.num_computed_tokens
            rows.append(row)
            computed.append(cached.num_computed_tokens)
            if cached.new_block_ids or cached.dropped_block_indices or cached.new_token_ids or \
                    (not samples and cached.sampled_token_ids):
                self._apply_changes(row, state, cached, samples)
        self.num_computed_tokens[rows] = computed

    def _apply_changes(self, row: int, state: CachedRequestState, cached: CachedRequestData, samples: bool) -> None:
        """A running request's new and dropped blocks and the tokens the diff brings."""
        if cached.dropped_block_indices:
            for index in cached.dropped_block_indices:
                state.block_ids[index] = -1
            self.block_table[row, cached.dropped_block_indices] = -1
        if cached.new_block_ids:
            self._append_blocks(row, state, cached.new_block_ids)
        if not samples and cached.sampled_token_ids:
            self.append_tokens(state.request_id, cached.sampled_token_ids)
        if cached.new_token_ids:
            self.append_tokens(state.request_id, cached.new_token_ids)

    def _add(self, state: CachedRequestState) -> None:
        row = self._free_rows.pop() if self._free_rows else self._new_row()
        self.requests[state.request_id] = state
        self.row_of[state.request_id] = row
        n, b = len(state.token_ids), len(state.block_ids)
        self._fit(tokens=n, blocks=b)
        self.token_ids[row, :n] = state.token_ids
        self.num_tokens[row] = n
        self.num_prompt_tokens[row] = state.num_prompt_tokens
        self.num_computed_tokens[row] = state.num_computed_tokens
        self.block_table[row, :b] = state.block_ids
        self.num_blocks[row] = b
        self.uids[row] = state.uid
        lora = state.lora_request
        self.lora_ids[row] = lora.lora_int_id if lora is not None else 0
        if lora is not None:
            self.lora_requests[lora.lora_int_id] = lora
        self.sampling.write(row, state.sampling_params)
        if self.row_listener is not None:
            self.row_listener.request_added(state)

    def _remove(self, req_id: str) -> None:
        row = self.row_of.pop(req_id, None)
        if row is None:
            return
        del self.requests[req_id]
        self.block_table[row, :self.num_blocks[row]] = 0  # a step's table pads with 0
        self.num_blocks[row] = 0
        self.num_tokens[row] = 0
        self.lora_ids[row] = 0
        self._free_rows.append(row)
        self.sampling.clear(row)
        if self.row_listener is not None:
            self.row_listener.request_removed(req_id)

    def _new_row(self) -> int:
        row = self._num_rows
        if row == len(self.num_tokens):
            self._grow_rows(2 * row)
        self._num_rows += 1
        return row

    def _append_blocks(self, row: int, state: CachedRequestState, block_ids: list[int]) -> None:
        start = len(state.block_ids)
        state.block_ids.extend(block_ids)
        self._fit(tokens=0, blocks=start + len(block_ids))
        self.block_table[row, start:start + len(block_ids)] = block_ids
        self.num_blocks[row] = start + len(block_ids)

    def append_tokens(self, req_id: str, tokens: Sequence[int]) -> None:
        """Tokens a request gained (sampled, accepted drafts, or sent with the diffs)."""
        state = self.requests[req_id]
        row = self.row_of[req_id]
        start = len(state.token_ids)
        state.token_ids.extend(tokens)
        self._fit(tokens=start + len(tokens), blocks=0)
        self.token_ids[row, start:start + len(tokens)] = tokens
        self.num_tokens[row] = start + len(tokens)

    def append_sampled(self, rows: np.ndarray, states: list[CachedRequestState], tokens: list[int]) -> None:
        """One token for each of `rows` (the step's sampling rows, `states` their records)."""
        if not len(rows):
            return
        for state, token in zip(states, tokens, strict=True):
            state.token_ids.append(token)
        ends = self.num_tokens[rows]
        self._fit(tokens=int(ends.max()) + 1, blocks=0)
        self.token_ids[rows, ends] = tokens
        self.num_tokens[rows] = ends + 1

    def set_last_tokens(self, rows: np.ndarray, states: list[CachedRequestState], tokens: list[int]) -> None:
        """Overwrite each row's last token (tensor parallelism: the first rank's choice wins)."""
        for state, token in zip(states, tokens, strict=True):
            state.token_ids[-1] = token
        self.token_ids[rows, self.num_tokens[rows] - 1] = tokens

    # ---- capacity --------------------------------------------------------------------------------
    def _fit(self, tokens: int, blocks: int) -> None:
        """Widen the token and block columns to hold `tokens` and `blocks` per row."""
        if tokens > self.token_ids.shape[1]:
            self.token_ids = _widen(self.token_ids, max(tokens, 2 * self.token_ids.shape[1]))
        if blocks > self.block_table.shape[1]:
            self.block_table = _widen(self.block_table, max(blocks, 2 * self.block_table.shape[1]))

    def _grow_rows(self, rows: int) -> None:
        for name in ("token_ids", "num_tokens", "num_prompt_tokens", "num_computed_tokens", "block_table",
                     "num_blocks", "uids", "lora_ids"):
            old = getattr(self, name)
            new = np.zeros((rows, *old.shape[1:]), dtype=old.dtype)
            new[:len(old)] = old
            setattr(self, name, new)
        self.sampling.grow(rows)

    # ---- one step --------------------------------------------------------------------------------
    def prepare(self, num_scheduled_tokens: dict[str, int], drafts: dict[str, list[int]] | None = None,
                num_kv_groups: int = 1) -> StepInputs:
        """The step's flat tensors for the scheduled requests, decodes first (stable: otherwise in
        the scheduler's order), gathered from the rows in numpy; as prepare_step_inputs builds them
        from scratch. Drafts go into the step's input ids only, never into the rows."""
        order = list(num_scheduled_tokens)
        num_reqs = len(order)
        lens = np.fromiter(num_scheduled_tokens.values(), dtype=np.int64, count=num_reqs)
        rows = np.fromiter(map(self.row_of.__getitem__, order), dtype=np.int64, count=num_reqs)
        decodes = lens == 1
        num_decodes = int(np.count_nonzero(decodes))
        if num_decodes < num_reqs and not decodes[:num_decodes].all():
            perm = np.argsort(~decodes, kind="stable")
            order = [order[i] for i in perm.tolist()]
            lens, rows = lens[perm], rows[perm]
        starts = self.num_computed_tokens[rows]
        seq_lens = starts + lens
        if drafts:
            num_drafts = np.fromiter((len(drafts.get(r, ())) for r in order), dtype=np.int64, count=num_reqs)
            sample_rows = np.nonzero(seq_lens >= self.num_tokens[rows] + num_drafts)[0]
        else:
            num_drafts = None
            sample_rows = np.nonzero(seq_lens >= self.num_tokens[rows])[0]
        self._fit(tokens=int(seq_lens.max()), blocks=0)  # a draft's position may lie past the row's tokens
        if num_decodes == num_reqs:  # one token per request: the request's index is the token's
            token_req = np.arange(num_reqs)
            query_start_loc = np.arange(num_reqs + 1)
            positions = starts
            input_ids = self.token_ids[rows, starts]
        else:
            query_start_loc = np.zeros(num_reqs + 1, dtype=np.int64)
            np.cumsum(lens, out=query_start_loc[1:])
            token_req = np.repeat(np.arange(num_reqs), lens)
            positions = np.arange(query_start_loc[-1], dtype=np.int64) + (starts - query_start_loc[:-1])[token_req]
            input_ids = self.token_ids[rows[token_req], positions]
        if num_drafts is not None:
            for i in np.nonzero(num_drafts)[0].tolist():
                end = int(query_start_loc[i + 1])
                input_ids[end - int(num_drafts[i]):end] = drafts[order[i]]  # type: ignore[index]
        block_tables = self.block_table[rows, :int(self.num_blocks[rows].max())]
        return assemble_step_inputs(order, rows, lens, num_decodes, seq_lens, query_start_loc, token_req, positions,
                                    input_ids, block_tables, self.uids[rows].tolist(), sample_rows, num_drafts,
                                    self.block_size, self.device, num_kv_groups)

    def step_lora_requests(self, inputs: StepInputs) -> list[LoRARequest | None]:
        """The LoRA adapter of each request of the step, in batch order (None: the base model)."""
        assert inputs.batch_rows is not None
        return [self.lora_requests[i] if i else None for i in self.lora_ids[inputs.batch_rows].tolist()]

    def sampling_metadata(self, inputs: StepInputs) -> tuple[list[CachedRequestState], SamplingMetadata]:
        """The sampling requests' records, in the order of `inputs.sample_rows`, and their
        SamplingMetadata from the rows' stored parameters."""
        assert inputs.batch_rows is not None
        rows = inputs.batch_rows[inputs.sample_rows]
        states = [self.requests[inputs.order[i]] for i in inputs.sample_rows]
        num_output = self.num_tokens[rows] - self.num_prompt_tokens[rows]
        return states, self.sampling.metadata(rows, states, num_output, self.device)


def _widen(array: np.ndarray, cols: int) -> np.ndarray:
    wider = np.zeros((array.shape[0], cols), dtype=array.dtype)
    wider[:, :array.shape[1]] = array
    return wider


def prepare_step_inputs(num_scheduled_tokens: dict[str, int], requests: dict[str, CachedRequestState],
                        block_size: int, device: torch.device,
                        drafts: dict[str, list[int]] | None = None, num_kv_groups: int = 1) -> StepInputs:
    """One step's flat tensors, decodes first, built from per-request records. The index math runs
    in numpy over the whole batch (a numpy op costs a fraction of a torch op's dispatch); only the
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
    qsl = np.array(query_start_loc, dtype=np.int64)
    # position of token t = t - (first token index of its request) + its request's start
    positions = np.arange(query_start_loc[-1], dtype=np.int64) + (np.array(starts, dtype=np.int64) - qsl[:-1])[token_req]
    return assemble_step_inputs(order, None, lens_np, lens.count(1), np.array(seq_lens, dtype=np.int64), qsl,
                                token_req, positions, np.array(input_ids, dtype=np.int64), flat_tables,
                                [state.uid for state in states], np.array(sample_rows, dtype=np.int64),
                                np.array(num_drafts, dtype=np.int64) if any(num_drafts) else None,
                                block_size, device, num_kv_groups)


def assemble_step_inputs(order: list[str], batch_rows: np.ndarray | None, lens: np.ndarray, num_decodes: int,
                         seq_lens: np.ndarray, query_start_loc: np.ndarray, token_req: np.ndarray,
                         positions: np.ndarray, input_ids: np.ndarray, block_tables: np.ndarray, row_uids: list[int],
                         sample_rows: np.ndarray, num_drafts: np.ndarray | None, block_size: int,
                         device: torch.device, num_kv_groups: int) -> StepInputs:
    """StepInputs from a step's per-request arrays (num_reqs,) in batch order, per-token arrays
    (num_tokens,), its block tables (num_reqs, max_blocks) int32, 0-padded, and the drafts per
    request (None: no drafts)."""
    on_device = _to_device_fn(device)
    qsl_cpu, seq_lens_cpu = query_start_loc.tolist(), seq_lens.tolist()
    shared = dict(
        num_reqs=len(order), num_decodes=num_decodes, num_actual_tokens=len(input_ids),
        query_start_loc=on_device(torch.from_numpy(query_start_loc.astype(np.int32))),
        seq_lens=on_device(torch.from_numpy(seq_lens.astype(np.int32))),
        max_query_len=int(lens.max()), max_seq_len=max(seq_lens_cpu), block_size=block_size,
        query_start_loc_cpu=qsl_cpu, seq_lens_cpu=seq_lens_cpu, row_uids=row_uids)
    block_of_token, offset = np.divmod(positions, block_size)

    def table_metadata(tables: np.ndarray) -> AttentionMetadata:
        slot_mapping = tables[token_req, block_of_token].astype(np.int64) * block_size + offset
        return AttentionMetadata(block_tables=on_device(torch.from_numpy(tables)),
                                 slot_mapping=on_device(torch.from_numpy(slot_mapping)),
                                 has_dropped_blocks=bool((tables < 0).any()), **shared)

    if num_kv_groups == 1:
        metadata = table_metadata(block_tables)
    else:  # kv_cache/hybrid.py: group g's entries are every G-th of the flat table, from g
        # copy(), not ascontiguousarray: numpy calls a (1, 1) slice contiguous and keeps its stride
        groups = [table_metadata(block_tables[:, g::num_kv_groups].copy()) for g in range(num_kv_groups)]
        metadata = groups[0]
        metadata.groups = groups
    ends = query_start_loc[1:][sample_rows]
    if num_drafts is None:  # per sampling request its last token
        logits_indices = ends - 1
    else:  # and each of its drafts: ends - 1 - drafts .. ends - 1
        counts = num_drafts[sample_rows] + 1
        logits_indices = np.repeat(ends - counts, counts) + _ranges(counts)
    return StepInputs(on_device(torch.from_numpy(input_ids)), on_device(torch.from_numpy(positions)), metadata,
                      order, sample_rows.tolist(), on_device(torch.from_numpy(logits_indices.astype(np.int64))),
                      batch_rows)


def _to_device_fn(device: torch.device):
    """to_device, or nothing at all on the CPU (the tensors are there already)."""
    if device.type == "cpu":
        return lambda tensor: tensor
    return lambda tensor: to_device(tensor, device)


def _ranges(counts: np.ndarray) -> np.ndarray:
    """[2, 3] -> [0, 1, 0, 1, 2]."""
    if not len(counts):
        return np.zeros(0, dtype=np.int64)
    starts = np.repeat(np.cumsum(counts) - counts, counts)
    return np.arange(int(counts.sum()), dtype=np.int64) - starts
