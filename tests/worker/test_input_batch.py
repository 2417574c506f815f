"""The persistent InputBatch, driven by seeded random sequences of SchedulerOutput diffs (new,
running, finished, preempted and resumed requests, forks sharing prefix blocks, dropped blocks,
jump-forward tokens, drafts, KV layer groups, a non-sampling pipeline stage), holds what a replay
of the same diffs into plain per-request records holds, and each step's inputs and sampling
metadata equal a from-scratch build from those records (prepare_step_inputs, SamplingMetadata.build)."""

from __future__ import annotations

import itertools
import random
from dataclasses import dataclass, field

import numpy as np
import pytest
import torch

from kvtide.sampling.metadata import SamplingMetadata
from kvtide.sampling_params import SamplingParams
from kvtide.scheduler.output import CachedRequestData, NewRequestData, SchedulerOutput
from kvtide.worker.input_batch import CachedRequestState, InputBatch, StepInputs, prepare_step_inputs

BLOCK_SIZE = 4
VOCAB = 50
CPU = torch.device("cpu")


@dataclass
class SimRequest:
    """The scheduler's side of one request in the simulation."""

    request_id: str
    token_ids: list[int]
    num_prompt_tokens: int
    params: SamplingParams
    block_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    unsent_tokens: list[int] = field(default_factory=list)
    """Sampled tokens a non-sampling stage has not been sent yet (CachedRequestData.sampled_token_ids)."""


def random_params(rng: random.Random) -> SamplingParams:
    kind = rng.choice(["greedy", "greedy", "random", "seeded"])
    extra = dict(top_k=rng.choice([-1, -1, 5, VOCAB + 3]), top_p=rng.choice([1.0, 0.9]),
                 min_p=rng.choice([0.0, 0.1]), presence_penalty=rng.choice([0.0, 0.0, 0.5]),
                 repetition_penalty=rng.choice([1.0, 1.0, 1.2]), min_tokens=rng.choice([0, 0, 3]),
                 logprobs=rng.choice([None, None, 0, 2]))
    if kind == "greedy":
        return SamplingParams(temperature=0.0, **extra)
    return SamplingParams(temperature=rng.choice([0.7, 1.0]), seed=rng.randrange(1 << 40) if kind == "seeded" else None,
                          **extra)


class Simulation:
    """A toy scheduler: each step it finishes, preempts, resumes, forks and admits requests and
    schedules the running ones, and emits the SchedulerOutput a runner would get. `replay` is
    what the runner must know, kept as plain records the way the runner kept them before the
    persistent batch (one CachedRequestState each, rebuilt in full when a request is resent)."""

    def __init__(self, seed: int, num_kv_groups: int, samples: bool) -> None:
        self.rng = random.Random(seed)
        self.groups = num_kv_groups
        self.samples = samples
        self.running: dict[str, SimRequest] = {}
        self.preempted: list[SimRequest] = []
        self.next_block = itertools.count(1)
        self.next_id = itertools.count()
        self.uids = itertools.count(1)
        self.replay: dict[str, CachedRequestState] = {}
        self.num_resumed = 0

    def blocks_for(self, num_tokens: int, have: int) -> list[int]:
        need = -(-num_tokens // BLOCK_SIZE) * self.groups
        return [next(self.next_block) for _ in range(max(0, need - have))]

    def step(self) -> tuple[SchedulerOutput, dict[str, list[int]]]:
        finished, new_reqs, copies = self.churn()
        num_sched, drafts, cached_reqs = self.schedule(new_reqs)
        so = SchedulerOutput(new_reqs, cached_reqs, num_sched, sum(num_sched.values()), finished_req_ids=finished,
                             block_copies=copies)
        self.apply_to_replay(so)
        return so, drafts

    def churn(self) -> tuple[set[str], list[NewRequestData], list[tuple[int, int]]]:
        """Requests end, are preempted, come back, arrive and fork."""
        rng = self.rng
        finished: set[str] = set()
        new_reqs: list[NewRequestData] = []
        copies: list[tuple[int, int]] = []
        for req_id in list(self.running):
            roll = rng.random()
            if roll < 0.06:
                finished.add(req_id)
                del self.running[req_id]
            elif roll < 0.12:  # preempted: its blocks go, it comes back later in full, with a fresh uid
                finished.add(req_id)
                request = self.running.pop(req_id)
                request.block_ids, request.num_computed_tokens = [], 0
                self.preempted.append(request)
        resumed = [r for r in self.preempted if rng.random() < 0.5]
        self.num_resumed += len(resumed)
        for request in resumed:
            self.preempted.remove(request)
            request.unsent_tokens = []  # sent in full: nothing left to relay
            # a prefix hit: some of the tokens are computed already, in fresh blocks
            request.num_computed_tokens = rng.randrange(0, len(request.token_ids)) // BLOCK_SIZE * BLOCK_SIZE
            request.block_ids = self.blocks_for(request.num_computed_tokens, 0)
            self.admit(request, new_reqs)
        for _ in range(rng.choice([0, 0, 1, 2])):
            prompt = [rng.randrange(VOCAB) for _ in range(rng.randint(1, 13))]
            self.admit(SimRequest(f"r{next(self.next_id)}", prompt, len(prompt), random_params(rng)), new_reqs)
        parents = [r for r in self.running.values() if r.num_computed_tokens > 0 and r.request_id not in finished
                   and not r.unsent_tokens and r.request_id not in {n.request_id for n in new_reqs}]
        if parents and rng.random() < 0.2:  # a fork: the child shares the parent's full blocks, copies its last
            parent = rng.choice(parents)
            full = parent.num_computed_tokens // BLOCK_SIZE * self.groups
            child = SimRequest(f"{parent.request_id}.c{next(self.next_id)}", list(parent.token_ids),
                               parent.num_prompt_tokens, parent.params, parent.block_ids[:full],
                               parent.num_computed_tokens)
            for src in parent.block_ids[full:]:
                child.block_ids.append(next(self.next_block))
                copies.append((src, child.block_ids[-1]))
            self.admit(child, new_reqs)
        return finished, new_reqs, copies

    def schedule(self, new_reqs: list[NewRequestData]) -> tuple[dict[str, int], dict[str, list[int]],
                                                               list[CachedRequestData]]:
        """Tokens for most running requests (a chunk, the rest, or a decode with drafts), with the
        blocks they need; the running ones' diffs."""
        rng = self.rng
        num_sched: dict[str, int] = {}
        drafts: dict[str, list[int]] = {}
        cached_reqs: list[CachedRequestData] = []
        new_by_id = {n.request_id: n for n in new_reqs}
        for req_id, request in self.running.items():
            if rng.random() < 0.15:
                continue  # not scheduled this step (the budget ran out)
            diff = None
            if req_id not in new_by_id:
                diff = CachedRequestData(req_id, [], request.num_computed_tokens)
                if not self.samples and request.unsent_tokens:
                    diff.sampled_token_ids, request.unsent_tokens = request.unsent_tokens, []
                if request.num_computed_tokens == len(request.token_ids) - 1 and rng.random() < 0.1:
                    diff.new_token_ids = [rng.randrange(VOCAB) for _ in range(rng.randint(1, 3))]  # jump-forward
                    request.token_ids += diff.new_token_ids
                full = request.num_computed_tokens // BLOCK_SIZE * self.groups
                live = [i for i in range(full) if request.block_ids[i] >= 0]
                if live and rng.random() < 0.15:
                    diff.dropped_block_indices = rng.sample(live, rng.randint(1, min(2, len(live))))
                    for i in diff.dropped_block_indices:
                        request.block_ids[i] = -1
            remaining = len(request.token_ids) - request.num_computed_tokens
            n = remaining if remaining == 1 or rng.random() < 0.5 else rng.randint(1, remaining)
            if remaining == 1 and rng.random() < 0.3:
                drafts[req_id] = [rng.randrange(VOCAB) for _ in range(rng.randint(0, 3))]
                n += len(drafts[req_id])
            new_blocks = self.blocks_for(request.num_computed_tokens + n, len(request.block_ids))
            request.block_ids += new_blocks
            if diff is not None:
                diff.new_block_ids = new_blocks
                cached_reqs.append(diff)
            else:
                new_by_id[req_id].block_ids = list(request.block_ids)
            num_sched[req_id] = n
        return num_sched, drafts, cached_reqs

    def admit(self, request: SimRequest, new_reqs: list[NewRequestData]) -> None:
        self.running[request.request_id] = request
        new_reqs.append(NewRequestData(request.request_id, list(request.token_ids), request.num_prompt_tokens,
                                       request.params, list(request.block_ids), request.num_computed_tokens))

    def apply_to_replay(self, so: SchedulerOutput) -> None:
        """The runner's former bookkeeping, step by step."""
        for req_id in so.finished_req_ids:
            self.replay.pop(req_id, None)
        for new in so.scheduled_new_reqs:
            self.replay[new.request_id] = CachedRequestState(
                new.request_id, list(new.token_ids), new.num_prompt_tokens, new.sampling_params,
                list(new.block_ids), new.num_computed_tokens, uid=next(self.uids))
        for cached in so.scheduled_cached_reqs:
            state = self.replay[cached.request_id]
            for index in cached.dropped_block_indices:
                state.block_ids[index] = -1
            state.block_ids.extend(cached.new_block_ids)
            state.num_computed_tokens = cached.num_computed_tokens
            if not self.samples:
                state.token_ids.extend(cached.sampled_token_ids)
            state.token_ids.extend(cached.new_token_ids)

    def finish_step(self, inputs: StepInputs, drafts: dict[str, list[int]]) -> dict[str, list[int]]:
        """Tokens each sampling request emits (accepted drafts, then one sampled), and the
        scheduler's progress. A non-sampling stage learns them only with the next diffs."""
        emitted = {}
        for req_id, request in self.running.items():
            if req_id not in inputs.order:
                continue
            n = inputs.metadata.query_start_loc_cpu[inputs.order.index(req_id) + 1] - \
                inputs.metadata.query_start_loc_cpu[inputs.order.index(req_id)]
            d = drafts.get(req_id, [])
            if inputs.order.index(req_id) in inputs.sample_rows:
                tokens = d[:self.rng.randint(0, len(d))] + [self.rng.randrange(VOCAB)]
                emitted[req_id] = tokens
                request.num_computed_tokens += n - len(d) + len(tokens) - 1
                if self.samples:
                    request.token_ids += tokens
                    self.replay[req_id].token_ids += tokens
                else:
                    request.token_ids += tokens
                    request.unsent_tokens += tokens
            else:
                request.num_computed_tokens += n
        return emitted


def assert_same_inputs(got: StepInputs, ref: StepInputs, num_kv_groups: int) -> None:
    assert got.order == ref.order and got.sample_rows == ref.sample_rows
    for name in ("input_ids", "positions", "logits_indices"):
        a, b = getattr(got, name), getattr(ref, name)
        assert a.dtype == b.dtype and torch.equal(a, b), name
    metas = [(got.metadata, ref.metadata)]
    if num_kv_groups > 1:
        assert len(got.metadata.groups) == len(ref.metadata.groups) == num_kv_groups
        metas = list(zip(got.metadata.groups, ref.metadata.groups, strict=True))
    for a, b in metas:
        for name in ("query_start_loc", "seq_lens", "block_tables", "slot_mapping"):
            x, y = getattr(a, name), getattr(b, name)
            assert x.dtype == y.dtype and torch.equal(x, y), name
        for name in ("num_reqs", "num_decodes", "num_actual_tokens", "max_query_len", "max_seq_len",
                     "query_start_loc_cpu", "seq_lens_cpu", "row_uids", "has_dropped_blocks"):
            assert getattr(a, name) == getattr(b, name), name


def assert_same_sampling(got: SamplingMetadata, ref: SamplingMetadata) -> None:
    assert (got.all_greedy, got.all_random, got.needs_processing, got.max_num_logprobs) == \
        (ref.all_greedy, ref.all_random, ref.needs_processing, ref.max_num_logprobs)
    for name in ("temperature", "greedy_mask", "top_k", "top_p", "min_p"):
        a, b = getattr(got, name), getattr(ref, name)
        assert (a is None) == (b is None), name
        if a is not None:
            assert a.dtype == b.dtype and torch.equal(a, b), name
    assert {i: g.initial_seed() for i, g in got.generators.items()} == \
        {i: g.initial_seed() for i, g in ref.generators.items()}
    for a, b in zip(got.rows, ref.rows, strict=True):
        assert a.params is b.params
        assert a.prompt_token_ids == b.prompt_token_ids and a.output_token_ids == b.output_token_ids


@pytest.mark.parametrize("seed,num_kv_groups,samples", [(0, 1, True), (1, 1, True), (2, 2, True), (3, 1, False),
                                                        (4, 3, True)])
def test_diffs_match_a_rebuild_from_scratch(seed, num_kv_groups, samples):
    sim = Simulation(seed, num_kv_groups, samples)
    # a tiny start, so rows, token columns and block columns all grow on the way
    batch = InputBatch(BLOCK_SIZE, VOCAB, CPU, max_num_reqs=1, max_model_len=8)
    uids = itertools.count(1)
    max_held = 0
    seen = {"fork": 0, "drafts": 0, "dropped": 0, "jump_forward": 0, "sampled": 0}
    for _ in range(120):
        so, drafts = sim.step()
        batch.update(so, uids, samples)
        seen["fork"] += bool(so.block_copies)
        seen["dropped"] += sum(bool(c.dropped_block_indices) for c in so.scheduled_cached_reqs)
        seen["drafts"] += sum(bool(d) for d in drafts.values())
        seen["jump_forward"] += sum(bool(c.new_token_ids) for c in so.scheduled_cached_reqs)
        seen["sampled"] += sum(bool(c.sampled_token_ids) for c in so.scheduled_cached_reqs)  # a non-sampling stage
        assert batch.requests.keys() == sim.replay.keys()
        for req_id, ref in sim.replay.items():
            assert batch.requests[req_id] == ref, req_id
            row = batch.row_of[req_id]
            n, b = len(ref.token_ids), len(ref.block_ids)
            assert batch.token_ids[row, :n].tolist() == ref.token_ids and batch.num_tokens[row] == n
            assert batch.block_table[row, :b].tolist() == ref.block_ids and not batch.block_table[row, b:].any()
            assert batch.num_computed_tokens[row] == ref.num_computed_tokens
        assert len(set(batch.row_of.values())) == len(batch.row_of)
        max_held = max(max_held, len(batch.requests))
        if not so.num_scheduled_tokens:
            continue
        got = batch.prepare(so.num_scheduled_tokens, drafts, num_kv_groups)
        ref = prepare_step_inputs(so.num_scheduled_tokens, sim.replay, BLOCK_SIZE, CPU, drafts, num_kv_groups)
        assert_same_inputs(got, ref, num_kv_groups)
        if got.sample_rows and samples:
            states, md = batch.sampling_metadata(got)
            assert [s.request_id for s in states] == [got.order[i] for i in got.sample_rows]
            ref_states = [sim.replay[got.order[i]] for i in got.sample_rows]
            assert_same_sampling(md, SamplingMetadata.build([s.row_state() for s in ref_states], VOCAB))
        emitted = sim.finish_step(got, drafts)
        if samples:
            rows = got.batch_rows[got.sample_rows]
            states = [batch.requests[got.order[i]] for i in got.sample_rows]
            single = [i for i, s in enumerate(states) if len(emitted[s.request_id]) == 1]
            batch.append_sampled(rows[single], [states[i] for i in single],
                                 [emitted[states[i].request_id][0] for i in single])
            for i, state in enumerate(states):
                if i not in single:
                    batch.append_tokens(state.request_id, emitted[state.request_id])
            seen["sampled"] += len(states)
    assert all(seen.values()) and sim.num_resumed, seen  # the sequence exercised every kind of diff
    # rows are reused: the arrays grew (doubling) to the most requests held at once, not one per request
    assert batch.token_ids.shape[0] < 2 * max_held


def test_sampling_tensors_are_reused_while_rows_and_parameters_stay():
    batch = InputBatch(BLOCK_SIZE, VOCAB, CPU)
    params = SamplingParams(temperature=0.8, top_p=0.9)
    new = [NewRequestData(f"r{i}", [1, 2, 3], 3, params, [i + 1], 0) for i in range(3)]
    batch.update(SchedulerOutput(new, [], {}, 0), itertools.count(1))
    inputs = batch.prepare({"r0": 3, "r1": 3, "r2": 3})
    _, first = batch.sampling_metadata(inputs)
    _, again = batch.sampling_metadata(inputs)
    assert again.top_p is first.top_p and again.temperature is first.temperature
    swap = NewRequestData("r1", [1, 2, 3], 3, SamplingParams(temperature=0.5), [9], 0)
    batch.update(SchedulerOutput([swap], [], {}, 0, finished_req_ids={"r1"}), itertools.count(10))
    _, changed = batch.sampling_metadata(batch.prepare({"r0": 3, "r1": 3, "r2": 3}))
    assert changed.temperature is not first.temperature
    assert changed.temperature.tolist() == pytest.approx([0.8, 0.5, 0.8])
    assert np.isclose(changed.top_p.numpy(), [0.9, 1.0, 0.9]).all()


def test_a_request_resent_in_full_replaces_its_row():
    """A request sent as new again (after a preemption the runner was not told of) starts over:
    its old tokens and blocks are gone, it gets a fresh uid, and its old row is free again."""
    batch = InputBatch(BLOCK_SIZE, VOCAB, CPU, max_num_reqs=2)
    params = SamplingParams()
    batch.update(SchedulerOutput([NewRequestData("a", [1, 2, 3, 4, 5], 3, params, [7, 8], 4)], [], {}, 0),
                 iter([1]))
    batch.update(SchedulerOutput([NewRequestData("a", [1, 2, 3], 3, params, [9], 0)], [], {}, 0), iter([2]))
    assert batch.requests["a"] == CachedRequestState("a", [1, 2, 3], 3, params, [9], 0, uid=2)
    batch.update(SchedulerOutput([NewRequestData("b", [4], 1, params, [3], 0)], [], {}, 0), iter([3]))
    assert sorted(batch.row_of.values()) == [0, 1]
    inputs = batch.prepare({"a": 3, "b": 1})
    assert inputs.order == ["b", "a"] and inputs.input_ids.tolist() == [4, 1, 2, 3]
    assert inputs.metadata.block_tables.tolist() == [[3], [9]] and inputs.metadata.row_uids == [3, 2]
