"""The scheduler driven through EngineCore with a fake runner.

The fake runner plays the model's part of the contract without tensors: it keeps each request's
state from the SchedulerOutput diffs, writes token ids into a paged fake KV cache through the
block table, and samples a token that is a function of what it reads back through the block
table. So a wrong block table, a bad prefix hit or a lost token after preemption changes the
output, and every request's expected output is known in advance (`expected_output`).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass, field

import pytest
from hypothesis import HealthCheck, given, seed, settings
from hypothesis import strategies as st

from kvtide.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from kvtide.engine.core import EngineCore
from kvtide.engine.messages import EngineCoreOutput
from kvtide.engine.request import EngineCoreRequest, RequestStatus
from kvtide.kv_cache.manager import cdiv
from kvtide.sampling_params import SamplingParams
from kvtide.scheduler.output import ModelRunnerOutput, SchedulerOutput, TopLogprobs

VOCAB = 50


def next_token(seq: list[int]) -> int:
    """The fake model: a deterministic function of the whole sequence read from the KV cache."""
    h = len(seq)
    for t in seq:
        h = (h * 31 + t + 7) % 1_000_003
    return h % VOCAB


def expected_output(prompt: list[int], max_tokens: int) -> list[int]:
    seq = list(prompt)
    for _ in range(max_tokens):
        seq.append(next_token(seq))
    return seq[len(prompt):]


@dataclass
class _RunnerState:
    token_ids: list[int]
    num_prompt_tokens: int
    block_ids: list[int]
    num_computed_tokens: int
    prompt_logprobs: int | None = None


class FakeRunner:
    """An Executor: SchedulerOutput -> ModelRunnerOutput, checking the contract on the way."""

    def __init__(self, num_blocks: int, block_size: int,
                 token_fn: Callable[[str, list[int], int], int] | None = None) -> None:
        self.block_size = block_size
        self.kv: list[list[int | None]] = [[None] * block_size for _ in range(num_blocks)]
        self.states: dict[str, _RunnerState] = {}
        self.token_fn = token_fn or (lambda rid, seq, num_prompt: next_token(seq))
        self.during_execute: Callable[[SchedulerOutput], None] | None = None
        self.outputs: list[SchedulerOutput] = []

    def execute(self, so: SchedulerOutput) -> ModelRunnerOutput:
        self.outputs.append(so)
        for rid in so.finished_req_ids:
            self.states.pop(rid, None)
        for new in so.scheduled_new_reqs:
            assert new.request_id not in self.states, f"{new.request_id} sent as new twice"
            assert len(new.token_ids) == new.num_prompt_tokens + new.num_output_tokens
            self.states[new.request_id] = _RunnerState(list(new.token_ids), new.num_prompt_tokens,
                                                       list(new.block_ids), new.num_computed_tokens,
                                                       new.sampling_params.prompt_logprobs)
        for cached in so.scheduled_cached_reqs:
            state = self.states[cached.request_id]
            assert cached.num_computed_tokens == state.num_computed_tokens
            state.block_ids.extend(cached.new_block_ids)
        scheduled = {n.request_id for n in so.scheduled_new_reqs} | \
            {c.request_id for c in so.scheduled_cached_reqs}
        assert scheduled == set(so.num_scheduled_tokens)
        assert so.total_num_scheduled_tokens == sum(so.num_scheduled_tokens.values())
        # Write every scheduled token's KV first (as each attention layer does), then sample.
        for rid, n in so.num_scheduled_tokens.items():
            state = self.states[rid]
            start = state.num_computed_tokens
            assert n > 0 and start + n <= len(state.token_ids)
            assert len(state.block_ids) * self.block_size >= start + n, "block table too short"
            for pos in range(start, start + n):
                self._write(rid, state.block_ids[pos // self.block_size], pos % self.block_size,
                            state.token_ids[pos])
        if self.during_execute is not None:
            self.during_execute(so)
        out = ModelRunnerOutput(sampled_token_ids={})
        for rid, n in so.num_scheduled_tokens.items():
            state = self.states[rid]
            self._prompt_logprobs(rid, state, n, out)
            state.num_computed_tokens += n
            if state.num_computed_tokens == len(state.token_ids):
                bs = self.block_size
                seq = [self.kv[state.block_ids[p // bs]][p % bs] for p in range(len(state.token_ids))]
                assert seq == state.token_ids, f"{rid} reads other tokens back from its KV"
                token = self.token_fn(rid, seq, state.num_prompt_tokens)
                state.token_ids.append(token)
                out.sampled_token_ids[rid] = token
        return out

    @staticmethod
    def _prompt_logprobs(rid: str, state: _RunnerState, n: int, out: ModelRunnerOutput) -> None:
        """As the real runner: logprobs of prompt tokens pos + 1 for the positions computed now.
        The fake logprob of token pos + 1 is -(pos + 1), so a test can tell positions apart."""
        start = state.num_computed_tokens
        end = min(start + n, state.num_prompt_tokens - 1)
        if state.prompt_logprobs is None or start >= end:
            return
        out.prompt_logprobs[rid] = [TopLogprobs(-float(pos + 1), 1, [state.token_ids[pos + 1]],
                                                [-float(pos + 1)]) for pos in range(start, end)]

    def _write(self, rid: str, block_id: int, slot: int, token: int) -> None:
        """A slot shared with another request (a prefix hit) may only be written with the same token."""
        for other_id, other in self.states.items():
            if other_id == rid or block_id not in other.block_ids:
                continue
            pos = other.block_ids.index(block_id) * self.block_size + slot
            if pos < len(other.token_ids):
                assert other.token_ids[pos] == token, f"{rid} overwrote KV that {other_id} holds"
        self.kv[block_id][slot] = token

    def shutdown(self) -> None:
        pass


def make_core(num_blocks: int = 64, block_size: int = 4, max_model_len: int = 256,
              max_num_seqs: int = 8, max_num_batched_tokens: int = 32, policy: str = "fcfs",
              enable_chunked_prefill: bool = True, enable_prefix_caching: bool = True,
              token_fn=None, async_scheduling: bool = False) -> EngineCore:
    config = EngineConfig(
        ModelConfig(model="fake", hf_config=None, max_model_len=max_model_len),
        CacheConfig(block_size=block_size, num_blocks=num_blocks,
                    enable_prefix_caching=enable_prefix_caching),
        SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
                        enable_chunked_prefill=enable_chunked_prefill, policy=policy,
                        async_scheduling=async_scheduling))
    return EngineCore(config, FakeRunner(num_blocks, block_size, token_fn))


_arrival = itertools.count()


def core_request(rid: str, prompt: list[int], priority: int = 0, eos: list[int] | None = None,
                 arrival: float | None = None, **params) -> EngineCoreRequest:
    params.setdefault("max_tokens", 8)
    return EngineCoreRequest(rid, prompt, SamplingParams(**params), eos or [],
                             float(next(_arrival)) if arrival is None else arrival, priority)


def prompt_of(n: int, salt: int = 0) -> list[int]:
    return [(salt * 7 + i * 3) % VOCAB for i in range(n)]


@dataclass
class Trace:
    """What a run saw: per-request tokens and finish reasons, and per-step facts."""

    tokens: dict[str, list[int]] = field(default_factory=dict)
    finish: dict[str, EngineCoreOutput] = field(default_factory=dict)
    steps: int = 0
    preempted: list[str] = field(default_factory=list)
    """Request ids in the order they were preempted."""
    first_scheduled: list[str] = field(default_factory=list)
    per_step: list[SchedulerOutput] = field(default_factory=list)
    prompt_logprobs: dict[str, list[float]] = field(default_factory=dict)


class Driver:
    """Runs an EngineCore step by step, checking the per-step invariants."""

    def __init__(self, core: EngineCore) -> None:
        self.core = core
        self.runner: FakeRunner = core.executor  # type: ignore[assignment]
        self.trace = Trace()
        self.ended: set[str] = set()

    @property
    def sched(self):
        return self.core.scheduler

    def add(self, request: EngineCoreRequest) -> None:
        self.core.add_request(request)
        self.trace.tokens.setdefault(request.request_id, [])

    def abort(self, rid: str) -> None:
        self.core.abort_requests([rid])
        self.ended.add(rid)
        assert rid not in self.sched.requests
        assert rid not in self.sched.kv_cache_manager.req_to_blocks, "aborted request kept its blocks"
        self.check_pool()

    def check_pool(self) -> None:
        mgr = self.sched.kv_cache_manager
        self.core.check_integrity()
        held = {b for blocks in mgr.req_to_blocks.values() for b in blocks}
        assert mgr.pool.num_used_blocks == len(held)
        assert set(mgr.req_to_blocks) <= {r.request_id for r in self.sched.running}
        for r in self.sched.waiting:
            assert r.request_id not in mgr.req_to_blocks, "a waiting request holds blocks"

    def step(self) -> list[EngineCoreOutput]:
        config = self.core.config.scheduler_config
        outputs = self.core.step()
        so = self.runner.outputs[self.trace.steps]  # the step just processed (the runner goes in order)
        self.trace.steps += 1
        self.trace.per_step.append(so)
        assert so.total_num_scheduled_tokens <= config.max_num_batched_tokens
        assert len(so.num_scheduled_tokens) <= config.max_num_seqs
        assert len(self.sched.running) <= config.max_num_seqs
        for rid in so.finished_req_ids:
            if rid in self.sched.requests:
                # Preempted; scheduled ahead, the next step may already have resumed it.
                allowed = {RequestStatus.PREEMPTED} | ({RequestStatus.RUNNING} if config.async_scheduling else set())
                assert self.sched.requests[rid].status in allowed
                self.trace.preempted.append(rid)
        for new in so.scheduled_new_reqs:
            if new.request_id not in self.trace.first_scheduled:
                self.trace.first_scheduled.append(new.request_id)
        for out in outputs:
            assert out.request_id not in self.ended, f"output for {out.request_id} after it ended"
            self.trace.tokens[out.request_id].extend(out.new_token_ids)
            for entry in out.new_prompt_logprobs or ():
                self.trace.prompt_logprobs.setdefault(out.request_id, []).append(entry[0])
            if out.finished:
                self.trace.finish[out.request_id] = out
                self.ended.add(out.request_id)
                assert out.request_id not in self.sched.requests
        self.check_pool()
        return outputs

    def run(self, max_steps: int = 10_000) -> Trace:
        while self.core.has_unfinished_requests():
            assert self.trace.steps < max_steps, "requests did not finish"
            self.step()
        return self.trace

    def assert_drained(self) -> None:
        pool = self.sched.kv_cache_manager.pool
        assert not self.core.has_unfinished_requests()
        assert not self.sched.requests and not self.sched.running and len(self.sched.waiting) == 0
        assert not self.sched.kv_cache_manager.req_to_blocks
        assert pool.num_free_blocks == pool.num_blocks
        assert all(b.ref_cnt == 0 for b in pool.blocks)
        self.core.check_integrity()


def step_bound(requests: list[EngineCoreRequest], budget: int, preempted: list[str]) -> int:
    """Steps a run may take: a step either spends the whole token budget, or gives every running
    request all it lacks (so one of them samples), or preempts. Tokens to compute are the prompts
    and outputs plus a recompute of the whole sequence per preemption."""
    by_id = {r.request_id: r for r in requests}
    longest = {rid: len(r.prompt_token_ids) + r.sampling_params.max_tokens for rid, r in by_id.items()}
    tokens = sum(longest.values()) + sum(longest[rid] for rid in preempted)
    samples = sum(r.sampling_params.max_tokens for r in requests)
    return cdiv(tokens, budget) + samples + len(preempted)


# ---- budget, chunking, mixing --------------------------------------------------------------------

def test_chunked_prefill_splits_a_long_prompt():
    d = Driver(make_core(max_num_batched_tokens=16))
    d.add(core_request("a", prompt_of(50), max_tokens=3))
    sizes, tokens_per_step = [], []
    while d.core.has_unfinished_requests():
        outs = d.step()
        sizes.append(d.trace.per_step[-1].num_scheduled_tokens["a"])
        tokens_per_step.append(sum(len(o.new_token_ids) for o in outs))
    assert sizes == [16, 16, 16, 2, 1, 1]
    assert tokens_per_step == [0, 0, 0, 1, 1, 1]  # no token until the whole prompt is in
    assert d.trace.tokens["a"] == expected_output(prompt_of(50), 3)
    d.assert_drained()


def test_prompt_waits_for_a_full_budget_without_chunked_prefill():
    d = Driver(make_core(max_num_batched_tokens=20, enable_chunked_prefill=False))
    d.add(core_request("a", prompt_of(4, 1), max_tokens=5))
    d.step()
    d.add(core_request("b", prompt_of(20, 2), max_tokens=2))
    d.step()  # a decodes (1 token); b's 20 tokens no longer fit in the 19 left
    assert d.trace.per_step[-1].num_scheduled_tokens == {"a": 1}
    d.run()
    assert 20 in [so.num_scheduled_tokens.get("b") for so in d.trace.per_step]
    assert d.trace.tokens["b"] == expected_output(prompt_of(20, 2), 2)
    d.assert_drained()


def test_decodes_and_prefill_chunks_share_a_step():
    d = Driver(make_core(max_num_batched_tokens=8))
    d.add(core_request("a", prompt_of(4, 1), max_tokens=10))
    d.step()
    d.add(core_request("b", prompt_of(30, 2), max_tokens=2))
    d.step()
    assert d.trace.per_step[-1].num_scheduled_tokens == {"a": 1, "b": 7}
    d.run()
    mixed = [so for so in d.trace.per_step
             if 1 in so.num_scheduled_tokens.values() and max(so.num_scheduled_tokens.values()) > 1]
    assert len(mixed) >= 3
    assert d.trace.tokens["a"] == expected_output(prompt_of(4, 1), 10)
    assert d.trace.tokens["b"] == expected_output(prompt_of(30, 2), 2)
    d.assert_drained()


def test_max_num_seqs_caps_running_requests():
    d = Driver(make_core(max_num_seqs=2, max_num_batched_tokens=64))
    for i in range(5):
        d.add(core_request(f"r{i}", prompt_of(5, i), max_tokens=3))
    d.step()
    assert set(d.trace.per_step[-1].num_scheduled_tokens) == {"r0", "r1"}
    d.run()
    for i in range(5):
        assert d.trace.tokens[f"r{i}"] == expected_output(prompt_of(5, i), 3)
    d.assert_drained()


# ---- preemption ----------------------------------------------------------------------------------

def _pressure_workload(d: Driver, priorities=(0, 0, 0)) -> list[EngineCoreRequest]:
    """Three requests of 1 block of prompt that each grow to 3 blocks: 9 blocks in a pool of 6."""
    reqs = [core_request(f"r{i}", prompt_of(4, i), priority=p, max_tokens=8, ignore_eos=True)
            for i, p in enumerate(priorities)]
    for r in reqs:
        d.add(r)
    return reqs


def test_preemption_takes_the_newest_request_first_under_fcfs():
    d = Driver(make_core(num_blocks=6, max_num_batched_tokens=64))
    reqs = _pressure_workload(d)
    d.run()
    assert d.trace.preempted and d.trace.preempted[0] == "r2"
    assert d.sched.num_preemptions == len(d.trace.preempted)
    for r in reqs:  # same tokens as without pressure
        assert d.trace.tokens[r.request_id] == expected_output(r.prompt_token_ids, 8)
        assert d.trace.finish[r.request_id].finish_reason == "length"
    assert d.trace.steps <= step_bound(reqs, 64, d.trace.preempted)
    d.assert_drained()


def test_preemption_takes_the_lowest_priority_first():
    """The lowest-priority request is the victim even when it was admitted first, so it comes
    first in the running list and already got its blocks this step."""
    d = Driver(make_core(num_blocks=5, max_num_batched_tokens=64, policy="priority"))
    d.add(core_request("low", prompt_of(3, 0), priority=9, max_tokens=8, ignore_eos=True))
    d.step()
    d.add(core_request("high", prompt_of(4, 1), priority=0, max_tokens=8, ignore_eos=True))
    d.run()
    # Both need a third block in the same step; the pool has one left.
    assert d.trace.preempted and d.trace.preempted[0] == "low", d.trace.preempted
    assert "high" not in d.trace.preempted
    assert d.trace.tokens["low"] == expected_output(prompt_of(3, 0), 8)
    assert d.trace.tokens["high"] == expected_output(prompt_of(4, 1), 8)
    d.assert_drained()


def test_priority_preemption_among_several_running():
    d = Driver(make_core(num_blocks=7, max_num_batched_tokens=64, policy="priority"))
    d.add(core_request("p5", prompt_of(3, 0), priority=5, max_tokens=8, ignore_eos=True))
    d.step()
    d.add(core_request("p0", prompt_of(4, 1), priority=0, max_tokens=8, ignore_eos=True))
    d.add(core_request("p3", prompt_of(4, 2), priority=3, max_tokens=8, ignore_eos=True))
    d.run()
    assert d.trace.preempted and d.trace.preempted[0] == "p5", d.trace.preempted
    assert "p0" not in d.trace.preempted
    for rid, n, salt in (("p5", 3, 0), ("p0", 4, 1), ("p3", 4, 2)):
        assert d.trace.tokens[rid] == expected_output(prompt_of(n, salt), 8)
    d.assert_drained()


@pytest.mark.parametrize("caching", [True, False])
def test_preempted_requests_resume_with_identical_output(caching):
    free = Driver(make_core(num_blocks=200, enable_prefix_caching=caching))
    tight = Driver(make_core(num_blocks=10, enable_prefix_caching=caching, max_num_batched_tokens=16))
    reqs = [core_request(f"r{i}", prompt_of(3 + 5 * i, i), max_tokens=12, ignore_eos=True)
            for i in range(5)]
    for d in (free, tight):
        for r in reqs:
            d.add(r)
        d.run()
        d.assert_drained()
    assert not free.trace.preempted and tight.trace.preempted
    assert tight.trace.tokens == free.trace.tokens
    assert tight.trace.steps <= step_bound(reqs, 16, tight.trace.preempted)


# ---- the property: random workloads, every request ends, correct tokens --------------------------

@st.composite
def workloads(draw):
    block_size = draw(st.sampled_from([2, 4, 8]))
    budget = draw(st.integers(4, 48))
    max_num_seqs = draw(st.integers(1, 6))
    policy = draw(st.sampled_from(["fcfs", "priority"]))
    caching = draw(st.booleans())
    shared = prompt_of(draw(st.integers(0, 12)), 99)  # a common prefix for cache hits
    reqs = []
    for i in range(draw(st.integers(1, 8))):
        own = draw(st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=30))
        prompt = (shared if draw(st.booleans()) else []) + own
        stop = draw(st.one_of(st.none(), st.integers(0, VOCAB - 1)))
        reqs.append(Arrival(
            draw(st.integers(0, 6)),
            core_request(f"r{i}", prompt, priority=draw(st.integers(0, 3)),
                         max_tokens=draw(st.integers(1, 12)), ignore_eos=True,
                         stop_token_ids=[] if stop is None else [stop]),
            draw(st.one_of(st.none(), st.none(), st.integers(0, 30)))))
    need = max(cdiv(len(a.request.prompt_token_ids) + a.request.sampling_params.max_tokens - 1,
                    block_size) for a in reqs)
    num_blocks = draw(st.integers(need, need + 10))
    return block_size, budget, max_num_seqs, policy, caching, num_blocks, reqs


@dataclass
class Arrival:
    step: int
    """Step at which the request is added."""
    request: EngineCoreRequest
    abort_step: int | None = None
    """Step at which it is aborted, if it has not ended by then."""


def expected_finish(request: EngineCoreRequest) -> tuple[list[int], str]:
    tokens = expected_output(request.prompt_token_ids, request.sampling_params.max_tokens)
    for i, t in enumerate(tokens):
        if t in request.sampling_params.stop_token_ids:
            return tokens[:i + 1], "stop"
    return tokens, "length"


def run_workload(workload, async_scheduling: bool = False) -> Driver:
    """Run arrivals and aborts step by step; every request ends within the bound with the tokens
    it would have produced alone, or a prefix of them if aborted."""
    block_size, budget, max_num_seqs, policy, caching, num_blocks, reqs = workload
    d = Driver(make_core(num_blocks=num_blocks, block_size=block_size, max_num_seqs=max_num_seqs,
                         max_num_batched_tokens=budget, policy=policy, enable_prefix_caching=caching,
                         async_scheduling=async_scheduling))
    pending = sorted(reqs, key=lambda a: a.step)
    added: list[Arrival] = []
    aborted: set[str] = set()
    step = 0
    while pending or d.core.has_unfinished_requests():
        while pending and pending[0].step <= step:
            added.append(pending.pop(0))
            d.add(added[-1].request)
        for a in added:
            rid = a.request.request_id
            if a.abort_step is not None and a.abort_step <= step and rid not in d.ended:
                d.abort(rid)
                aborted.add(rid)
        if d.core.has_unfinished_requests():
            d.step()
        step += 1
        assert step < 5000
    core_reqs = [a.request for a in reqs]
    # Scheduled ahead, a step can also be one that a request's last (stopping) token leaves empty.
    slack = len(core_reqs) + 1 if async_scheduling else 0
    assert d.trace.steps <= step_bound(core_reqs, budget, d.trace.preempted) + slack
    for r in core_reqs:
        tokens, reason = expected_finish(r)
        got = d.trace.tokens[r.request_id]
        if r.request_id in aborted:
            assert r.request_id not in d.trace.finish and got == tokens[:len(got)]
        else:
            assert (got, d.trace.finish[r.request_id].finish_reason) == (tokens, reason)
    d.assert_drained()
    return d


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow], database=None)
@given(workloads())
def test_random_workloads_end_with_correct_tokens_within_the_bound(workload):
    run_workload(workload)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow], database=None)
@given(workloads())
def test_random_workloads_scheduled_ahead_end_with_the_same_tokens(workload):
    """Async scheduling (each step scheduled while the one before runs): the same tokens, aborts,
    preemption and prefix hits, and every block back in the pool."""
    run_workload(workload, async_scheduling=True)


@pytest.mark.slow
@seed(20240611)
@settings(max_examples=1500, deadline=None, suppress_health_check=list(HealthCheck), database=None)
@given(workloads())
def test_random_workloads_soak(workload):
    run_workload(workload)


# ---- aborts in every state -----------------------------------------------------------------------

def _abort_scenario(state: str) -> None:
    d = Driver(make_core(num_blocks=12, max_num_batched_tokens=8))
    keep = core_request("keep", prompt_of(4, 1), max_tokens=20, ignore_eos=True)
    # keep grows to 6 blocks, victim to 10: more than the 12 in the pool, so victim (newest) is
    # preempted at some point.
    victim = core_request("victim", prompt_of(30, 2), max_tokens=10, ignore_eos=True)
    d.add(keep)
    if state == "queued":
        d.add(victim)
        d.abort("victim")
    else:
        d.step()
        d.add(victim)
        d.step()
        req = d.sched.requests["victim"]
        if state == "mid_prefill":
            assert 0 < req.num_computed_tokens < req.num_prompt_tokens
            d.abort("victim")
        elif state == "decoding":
            while req.num_output_tokens < 2:
                assert req.status == RequestStatus.RUNNING
                d.step()
            assert req.status == RequestStatus.RUNNING
            d.abort("victim")
        elif state == "preempted":
            while req.status != RequestStatus.PREEMPTED:
                assert not req.is_finished() and d.trace.steps < 100
                d.step()
            assert "victim" in {r.request_id for r in d.sched.waiting}
            d.abort("victim")
        elif state == "during_step":
            d.runner.during_execute = lambda so: d.abort("victim") if "victim" in d.sched.requests else None
            d.step()
            d.runner.during_execute = None
    so_count = len(d.runner.outputs)
    d.run()
    assert "victim" not in d.trace.finish
    # The runner is told to drop it, and it is never scheduled again.
    later = d.runner.outputs[so_count:]
    if state != "queued" and later:
        assert any("victim" in so.finished_req_ids for so in d.runner.outputs)
    assert all("victim" not in so.num_scheduled_tokens for so in later)
    assert d.trace.tokens["keep"] == expected_output(keep.prompt_token_ids, 20)
    d.assert_drained()


@pytest.mark.parametrize("state", ["queued", "mid_prefill", "decoding", "preempted", "during_step"])
def test_abort_in_every_state_frees_blocks_at_once(state):
    _abort_scenario(state)


def test_abort_of_unknown_or_finished_ids_is_a_no_op():
    d = Driver(make_core())
    d.add(core_request("a", prompt_of(5), max_tokens=2))
    d.run()
    d.core.abort_requests(["a", "nope"])
    d.assert_drained()


# ---- admission -----------------------------------------------------------------------------------

def _snapshot(core: EngineCore):
    s = core.scheduler
    pool = s.kv_cache_manager.pool
    return (dict(s.requests), [r.request_id for r in s.waiting], list(s.running),
            list(pool._free), [b.ref_cnt for b in pool.blocks])


def test_request_that_can_never_fit_is_rejected_and_nothing_changes():
    d = Driver(make_core(num_blocks=4, block_size=4))
    d.add(core_request("ok", prompt_of(5), max_tokens=3))
    d.step()
    before = _snapshot(d.core)
    # 14 prompt + 4 output tokens: the KV of 17 tokens needs 5 blocks of 4; the pool has 4.
    with pytest.raises(ValueError, match="KV blocks"):
        d.core.add_request(core_request("big", prompt_of(14), max_tokens=4))
    assert _snapshot(d.core) == before
    with pytest.raises(ValueError, match="already in use"):
        d.core.add_request(core_request("ok", prompt_of(3), max_tokens=1))
    assert _snapshot(d.core) == before
    d.run()
    d.assert_drained()


@pytest.mark.parametrize("prompt_len,max_tokens", [(16, 1), (13, 4), (15, 2), (8, 9)])
def test_request_that_exactly_fits_the_pool_is_admitted_and_finishes(prompt_len, max_tokens):
    """The last sampled token is never written to the cache, so prompt + max_tokens - 1 tokens of
    KV is all a request ever needs."""
    d = Driver(make_core(num_blocks=4, block_size=4, max_num_batched_tokens=8))
    r = core_request("a", prompt_of(prompt_len), max_tokens=max_tokens, ignore_eos=True)
    d.add(r)
    d.run()
    assert d.trace.tokens["a"] == expected_output(r.prompt_token_ids, max_tokens)
    d.assert_drained()


def test_max_model_len_bounds_what_admission_reserves():
    d = Driver(make_core(num_blocks=4, block_size=4, max_model_len=17))
    r = core_request("a", prompt_of(6), max_tokens=None, ignore_eos=True)
    d.add(r)
    d.run()
    assert len(d.trace.tokens["a"]) == 11 and d.trace.finish["a"].finish_reason == "length"
    with pytest.raises(ValueError):
        Driver(make_core(num_blocks=4, block_size=4, max_model_len=18)).add(
            core_request("b", prompt_of(6), max_tokens=None))


@pytest.mark.parametrize("policy", ["fcfs", "priority"])
def test_admission_order_follows_the_policy(policy):
    d = Driver(make_core(max_num_seqs=1, policy=policy))
    prios = {"a": 3, "b": 1, "c": 2, "d": 1, "e": 0}
    for rid, p in prios.items():
        d.add(core_request(rid, prompt_of(3), priority=p, max_tokens=2))
    d.run()
    if policy == "fcfs":
        assert d.trace.first_scheduled == list(prios)
    else:
        assert d.trace.first_scheduled == ["e", "b", "d", "c", "a"]
    d.assert_drained()


def test_priority_request_arriving_later_is_admitted_before_queued_lower_ones():
    d = Driver(make_core(max_num_seqs=1, policy="priority"))
    d.add(core_request("first", prompt_of(3), priority=5, max_tokens=3))
    d.add(core_request("queued", prompt_of(3, 1), priority=5, max_tokens=3))
    d.step()
    d.add(core_request("urgent", prompt_of(3, 2), priority=0, max_tokens=3))
    d.run()
    assert d.trace.first_scheduled == ["first", "urgent", "queued"]
    d.assert_drained()


# ---- finish reasons ------------------------------------------------------------------------------

def scripted(scripts: dict[str, list[int]]):
    """token_fn whose i-th output token for a request is scripts[rid][i]."""
    return lambda rid, seq, num_prompt: scripts[rid][len(seq) - num_prompt]


def test_finish_reasons():
    script = [5, 6, 7, 6, 8, 9, 9, 9, 9, 9, 9, 9]
    names = ["stop_id", "eos", "ignore_eos", "min_tokens", "max_tokens", "model_len", "eos_in_stop_ids"]
    d = Driver(make_core(max_model_len=12, token_fn=scripted({n: script for n in names})))
    p = prompt_of(4)
    d.add(core_request("stop_id", p, stop_token_ids=[7], max_tokens=10))
    d.add(core_request("eos", p, eos=[6], max_tokens=10))
    d.add(core_request("ignore_eos", p, eos=[6], ignore_eos=True, max_tokens=5))
    d.add(core_request("min_tokens", p, eos=[6], min_tokens=3, max_tokens=10))
    d.add(core_request("max_tokens", p, max_tokens=3))
    d.add(core_request("model_len", p, max_tokens=None))
    d.add(core_request("eos_in_stop_ids", p, eos=[6], ignore_eos=True, stop_token_ids=[6], max_tokens=10))
    d.run()
    t, f = d.trace.tokens, d.trace.finish
    assert (t["stop_id"], f["stop_id"].finish_reason, f["stop_id"].stop_reason) == ([5, 6, 7], "stop", 7)
    assert (t["eos"], f["eos"].finish_reason, f["eos"].stop_reason) == ([5, 6], "stop", None)
    assert (t["ignore_eos"], f["ignore_eos"].finish_reason) == ([5, 6, 7, 6, 8], "length")
    assert (t["min_tokens"], f["min_tokens"].finish_reason) == ([5, 6, 7, 6], "stop")
    assert (t["max_tokens"], f["max_tokens"].finish_reason) == ([5, 6, 7], "length")
    assert (t["model_len"], f["model_len"].finish_reason) == (script[:8], "length")
    assert (t["eos_in_stop_ids"], f["eos_in_stop_ids"].stop_reason) == ([5, 6], 6)
    d.assert_drained()


def test_stop_token_inside_min_tokens_is_not_a_stop():
    d = Driver(make_core(token_fn=scripted({"a": [7, 7, 7, 7, 7]})))
    d.add(core_request("a", prompt_of(4), stop_token_ids=[7], min_tokens=2, max_tokens=5))
    d.run()
    assert d.trace.tokens["a"] == [7, 7] and d.trace.finish["a"].stop_reason == 7
    d.assert_drained()


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_runner_failure_fails_only_that_request(async_scheduling):
    class FailingRunner(FakeRunner):
        def execute(self, so):
            out = super().execute(so)
            if "bad" in out.sampled_token_ids:
                del out.sampled_token_ids["bad"]  # the runner still keeps a token for a step scheduled ahead
                out.failed["bad"] = "non-finite logits"
            return out

    core = make_core(async_scheduling=async_scheduling)
    core.executor = FailingRunner(64, 4)
    d = Driver(core)
    d.add(core_request("bad", prompt_of(5), max_tokens=4))
    d.add(core_request("good", prompt_of(6, 1), max_tokens=4))
    d.run()
    assert d.trace.finish["bad"].finish_reason == "abort" and d.trace.finish["bad"].error
    assert d.trace.tokens["good"] == expected_output(prompt_of(6, 1), 4)
    d.assert_drained()


def test_prefix_hits_skip_cached_blocks_and_keep_output():
    d = Driver(make_core(block_size=4))
    base = prompt_of(13, 3)
    d.add(core_request("a", base, max_tokens=4))
    d.run()
    d.add(core_request("b", base[:12] + [1, 2], max_tokens=4))
    d.step()
    new = d.trace.per_step[-1].scheduled_new_reqs[0]
    assert new.num_computed_tokens == 12 and d.trace.per_step[-1].num_scheduled_tokens["b"] == 2
    d.run()
    assert d.trace.tokens["b"] == expected_output(base[:12] + [1, 2], 4)
    d.assert_drained()


# ---- what the output side sees across preemption -------------------------------------------------

def test_prompt_logprobs_are_sent_once_per_position_across_preemption():
    """A preempted request computes its prompt again; the output side must not get the prompt
    logprobs a second time (it appends them by position)."""
    d = Driver(make_core(num_blocks=10, max_num_batched_tokens=8))
    d.add(core_request("keep", prompt_of(4, 1), max_tokens=20, ignore_eos=True))
    d.step()
    d.add(core_request("plp", prompt_of(20, 2), max_tokens=8, ignore_eos=True, prompt_logprobs=1))
    d.run()
    assert "plp" in d.trace.preempted
    assert d.trace.prompt_logprobs["plp"] == [-float(pos) for pos in range(1, 20)]
    assert d.trace.tokens["plp"] == expected_output(prompt_of(20, 2), 8)
    d.assert_drained()


def test_prefix_cache_stats_count_each_request_once():
    """A request that waits several steps for blocks is looked up each step; it is one query."""
    d = Driver(make_core(num_blocks=6, max_num_batched_tokens=64))
    base = prompt_of(12, 5)
    d.add(core_request("a", base, max_tokens=8, ignore_eos=True))
    d.add(core_request("b", base[:8] + [1, 2, 3, 4], max_tokens=8, ignore_eos=True))
    d.add(core_request("c", prompt_of(9, 6), max_tokens=8, ignore_eos=True))
    d.run()
    stats = d.core.get_stats()
    assert stats.prefix_cache_queries == 12 + 12 + 9
    assert stats.prefix_cache_hits == 8  # b reuses a's first two blocks
    d.assert_drained()


# ---- async scheduling ----------------------------------------------------------------------------

@pytest.mark.parametrize("async_scheduling", [False, True])
def test_finish_reasons_scheduled_ahead(async_scheduling):
    """Each step is scheduled before the one before it reports: a request that stops on a token
    had one more step computed, which is dropped; one that ends by length is not scheduled past it."""
    script = [5, 6, 7, 6, 8, 9, 9, 9, 9, 9]
    d = Driver(make_core(token_fn=scripted({"stop": script, "length": script}),
                         async_scheduling=async_scheduling))
    d.add(core_request("stop", prompt_of(4), stop_token_ids=[7], max_tokens=10))
    d.add(core_request("length", prompt_of(5, 1), max_tokens=4, ignore_eos=True))
    d.run()
    assert d.trace.tokens == {"stop": [5, 6, 7], "length": [5, 6, 7, 6]}
    assert d.trace.finish["stop"].finish_reason == "stop" and d.trace.finish["length"].finish_reason == "length"
    executed = {rid: sum(rid in so.num_scheduled_tokens for so in d.runner.outputs) for rid in ("stop", "length")}
    assert executed == {"stop": 4 if async_scheduling else 3, "length": 4}
    if async_scheduling:  # the step after the stop was scheduled before the stop was known
        assert any(so.num_scheduled_tokens.get("stop") and "stop" in so.sampling_req_ids
                   for so in d.runner.outputs[3:])
    d.assert_drained()

