"""prepare_step_inputs (numpy index math) and the persistent InputBatch give the tensors of the
plain torch construction they replaced, on mixed batches of decodes, prefill chunks and chunks
with cached prefixes."""

from __future__ import annotations

import random

import torch

from kvtide.sampling_params import SamplingParams
from kvtide.scheduler.output import NewRequestData, SchedulerOutput
from kvtide.worker.input_batch import CachedRequestState, InputBatch, prepare_step_inputs

BLOCK_SIZE = 4


def reference_inputs(num_sched: dict[str, int], requests: dict[str, CachedRequestState], block_size: int):
    """The former ModelRunner._prepare_inputs, tensor by tensor."""
    order = sorted(num_sched, key=lambda r: num_sched[r] != 1)
    input_ids, positions, query_start_loc, seq_lens, sample_rows = [], [], [0], [], []
    for i, req_id in enumerate(order):
        state = requests[req_id]
        start, n = state.num_computed_tokens, num_sched[req_id]
        input_ids.extend(state.token_ids[start:start + n])
        positions.extend(range(start, start + n))
        query_start_loc.append(query_start_loc[-1] + n)
        seq_lens.append(start + n)
        if start + n >= len(state.token_ids):
            sample_rows.append(i)
    max_blocks = max(len(requests[r].block_ids) for r in order)
    block_tables = torch.tensor([requests[r].block_ids + [0] * (max_blocks - len(requests[r].block_ids))
                                 for r in order], dtype=torch.int32)
    positions_t = torch.tensor(positions, dtype=torch.int64)
    lens = torch.tensor([num_sched[r] for r in order], dtype=torch.int64)
    token_req = torch.repeat_interleave(torch.arange(len(order)), lens)
    block_of_token = block_tables[token_req, positions_t // block_size].to(torch.int64)
    slot_mapping = block_of_token * block_size + positions_t % block_size
    return dict(order=order, sample_rows=sample_rows, input_ids=torch.tensor(input_ids, dtype=torch.int64),
                positions=positions_t, query_start_loc=torch.tensor(query_start_loc, dtype=torch.int32),
                seq_lens=torch.tensor(seq_lens, dtype=torch.int32), block_tables=block_tables,
                slot_mapping=slot_mapping, max_query_len=int(lens.max()), max_seq_len=max(seq_lens),
                num_decodes=sum(1 for r in order if num_sched[r] == 1),
                logits_indices=torch.tensor([query_start_loc[i + 1] - 1 for i in sample_rows], dtype=torch.int64))


def random_batch(rng: random.Random):
    requests, num_sched = {}, {}
    block_pool = list(range(1, 500))
    rng.shuffle(block_pool)
    for r in range(rng.randint(1, 9)):
        kind = rng.choice(["decode", "prefill", "chunk", "cached_prefix"])
        prompt = rng.randint(1, 40)
        tokens = [rng.randrange(1000) for _ in range(prompt + (rng.randint(1, 10) if kind == "decode" else 0))]
        if kind == "decode":
            computed, n = len(tokens) - 1, 1
        elif kind == "prefill":
            computed, n = 0, len(tokens)
        else:  # a chunk that does not reach the end, or the rest after a cached prefix
            computed = rng.randint(0, len(tokens) - 1)
            n = rng.randint(1, len(tokens) - computed) if kind == "chunk" else len(tokens) - computed
        num_blocks = -(-(computed + n) // BLOCK_SIZE) + rng.randint(0, 2)
        blocks = [block_pool.pop() for _ in range(num_blocks)]
        req_id = f"r{r}"
        requests[req_id] = CachedRequestState(req_id, tokens, prompt, SamplingParams(), blocks, computed, uid=r + 1)
        num_sched[req_id] = n
    return num_sched, requests


def from_input_batch(num_sched: dict[str, int], requests: dict[str, CachedRequestState]):
    """The same step from an InputBatch that received the requests as new ones."""
    batch = InputBatch(BLOCK_SIZE, 1000, torch.device("cpu"), max_num_reqs=2, max_model_len=16)
    new = [NewRequestData(r.request_id, r.token_ids, r.num_prompt_tokens, r.sampling_params, r.block_ids,
                          r.num_computed_tokens) for r in requests.values()]
    batch.update(SchedulerOutput(new, [], {}, 0), iter([r.uid for r in requests.values()]))
    return batch.prepare(num_sched)


def test_matches_reference_on_mixed_batches():
    rng = random.Random(0)
    for _ in range(200):
        num_sched, requests = random_batch(rng)
        ref = reference_inputs(num_sched, requests, BLOCK_SIZE)
        for got in (prepare_step_inputs(num_sched, requests, BLOCK_SIZE, torch.device("cpu")),
                    from_input_batch(num_sched, requests)):
            assert_matches(got, ref, requests)


def assert_matches(got, ref, requests):
    md = got.metadata
    assert got.order == ref["order"] and got.sample_rows == ref["sample_rows"]
    for name, tensor in (("input_ids", got.input_ids), ("positions", got.positions),
                         ("query_start_loc", md.query_start_loc), ("seq_lens", md.seq_lens),
                         ("block_tables", md.block_tables), ("slot_mapping", md.slot_mapping),
                         ("logits_indices", got.logits_indices)):
        assert tensor.dtype == ref[name].dtype and torch.equal(tensor, ref[name]), name
    assert md.num_decodes == ref["num_decodes"] and md.num_reqs == len(ref["order"])
    assert md.num_actual_tokens == ref["input_ids"].numel()
    assert md.max_query_len == ref["max_query_len"] and md.max_seq_len == ref["max_seq_len"]
    assert md.query_start_loc_cpu == ref["query_start_loc"].tolist()
    assert md.seq_lens_cpu == ref["seq_lens"].tolist()
    assert md.row_uids == [requests[r].uid for r in ref["order"]]
