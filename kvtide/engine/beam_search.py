"""Beam search in the engine core, plugged in through three hooks around the scheduler step.

    EngineCore.add_request  -> BeamSearch.add_request     a group per user request
    EngineCore.step         -> BeamSearch.take_results    the beams' rows leave the runner output
                            -> BeamSearch.advance         pick, fork and drop beams; emit finished groups

Each step every running beam computes its last token and the runner returns the top-K next-token
log-probabilities (K = max(2, 1 + number of stop ids) * beam_width). The group keeps the K best
continuations over all beams and updates finished and running beams exactly as HF
`generate(num_beams=..., do_sample=False)` does (scores in float32, the same length penalty and
early-stopping rules), so the returned sequences and their order match:

    beams   (score)        candidates (score + logprob)          next step
    b0 "The cat" -2.1  -+-> "The cat sat"   -2.9  ------------->  fork(b0) + "sat"
                        +-> "The cat </s>"  -3.0  -> finished (if among the top beam_width)
    b1 "The dog" -2.4  ---> "The dog ran"   -3.1  ------------->  fork(b1) + "ran"
    b2 "A cat"   -2.6       (no continuation kept)                dropped: its blocks are freed

A next beam is a new engine-core request forked from its parent (KVCacheManager.fork: the blocks
are shared by reference count, and the partial last block is copied only by a branch that writes
into it); the old beams are freed right after, so a beam continued once costs no copy.

With structured output each beam carries its own grammar matcher (a fork of its parent's, advanced
by the token it continues with); the runner masks each beam's logits, so a token the grammar
forbids has logprob -inf and is never a candidate.
"""

from __future__ import annotations

import copy
import dataclasses
import math
from dataclasses import dataclass, field

import numpy as np

from kvtide.engine.messages import EngineCoreOutput
from kvtide.engine.request import EngineCoreRequest, Request, RequestStatus
from kvtide.sampling_params import SamplingParams
from kvtide.scheduler.output import ModelRunnerOutput, TopLogprobs
from kvtide.scheduler.scheduler import Scheduler

# (logprob, rank, top ids, top logprobs) of one generated token, as EngineCoreOutput carries it.
TokenLogprob = tuple[float, int, list[int], list[float]]


@dataclass
class _Beam:
    request: Request
    score: float
    """Cumulative logprob, a float32 value."""
    logprobs: list[TokenLogprob]


@dataclass
class _Hypothesis:
    """A finished beam."""

    score: float
    """Cumulative logprob / generated_len ** length_penalty (float32)."""
    token_ids: list[int]
    logprobs: list[TokenLogprob]


@dataclass
class BeamGroup:
    """One beam-search request: its running beams, its finished hypotheses, and the output ids the
    results go out under (the engine-core ids of the user request's n sequences)."""

    root_id: str
    output_ids: list[str]
    params: SamplingParams
    """The user's parameters."""
    beam_params: SamplingParams
    """What each beam runs with: greedy, top-K logprobs, no prompt logprobs."""
    prompt_len: int
    max_length: int
    """Prompt + generated tokens at most (HF's max_length)."""
    stop_ids: frozenset[int]
    beams: list[_Beam] = field(default_factory=list)
    finished: list[_Hypothesis] = field(default_factory=list)
    improvable: bool = True
    """HF's is_early_stop_heuristic_unsatisfied: a running beam may still beat a finished one."""
    reports: dict[str, TopLogprobs] = field(default_factory=dict)
    """This step's top-K logprobs, per beam request id."""
    num_steps: int = 0
    num_cached_tokens: int = 0
    error: str | None = None

    @property
    def num_beams(self) -> int:
        return self.params.num_beams

    @property
    def num_candidates(self) -> int:
        return max(2, 1 + len(self.stop_ids)) * self.num_beams


class BeamSearch:
    def __init__(self, scheduler: Scheduler) -> None:
        self.scheduler = scheduler
        self.groups: dict[str, BeamGroup] = {}
        """root id (the first output id) -> group."""
        self._beam_group: dict[str, str] = {}
        """running beam's request id -> root id."""
        self._output_group: dict[str, str] = {}
        """output id -> root id."""

    def has_groups(self) -> bool:
        return bool(self.groups)

    # ---- hooks -----------------------------------------------------------------------------
    def add_request(self, core_request: EngineCoreRequest) -> bool:
        """Take a beam-search request (True); others go to the scheduler as usual (False).

        The root beam is admitted to the scheduler; the other output slots (fork_of the root) only
        register as places the results go."""
        params = core_request.sampling_params
        if not params.use_beam_search:
            return False
        if core_request.fork_of is not None:
            group = self.groups.get(core_request.fork_of)
            if group is None:
                raise ValueError(f"beam search: no root beam {core_request.fork_of!r} for "
                                 f"{core_request.request_id!r}")
            group.output_ids.append(core_request.request_id)
            self._output_group[core_request.request_id] = group.root_id
            return True
        group = self._new_group(core_request)
        root_params = copy.copy(group.beam_params)  # not replace(): logprobs may exceed the cap
        root_params.prompt_logprobs = params.prompt_logprobs
        root = Request(dataclasses.replace(core_request, sampling_params=root_params))
        self.scheduler.add_request(root)
        group.beams = [_Beam(root, 0.0, [])]
        self.groups[group.root_id] = group
        self._beam_group[root.request_id] = self._output_group[root.request_id] = group.root_id
        return True

    def take_results(self, runner_output: ModelRunnerOutput) -> None:
        """Move the beams' sampled rows out of the runner output: the group, not the sampler,
        chooses how each beam continues, so the scheduler must not append a token for them."""
        if not self.groups:
            return
        for req_id in [r for r in runner_output.sampled_token_ids if r in self._beam_group]:
            runner_output.sampled_token_ids.pop(req_id)
            self.groups[self._beam_group[req_id]].reports[req_id] = runner_output.logprobs.pop(req_id)
        for req_id in [r for r in runner_output.failed if r in self._beam_group]:
            self.groups[self._beam_group[req_id]].error = runner_output.failed.pop(req_id)

    def advance(self, stalled: bool = False) -> list[EngineCoreOutput]:
        """Step every group whose beams all reported; return the outputs of groups that ended.
        `stalled`: the step scheduled nothing (see _park_reported_beams)."""
        if stalled:
            self._park_reported_beams()
        outputs: list[EngineCoreOutput] = []
        for group in list(self.groups.values()):
            if group.error is not None:
                outputs.extend(self._end(group, "abort"))
            elif group.beams and len(group.reports) == len(group.beams):
                if self._step(group):
                    outputs.extend(self._end(group, None))
        return outputs

    def abort(self, request_ids: list[str]) -> list[str]:
        """End the groups any of `request_ids` belongs to; returns the ids that are not beams'."""
        rest = []
        for req_id in request_ids:
            root_id = self._output_group.get(req_id, self._beam_group.get(req_id))
            if root_id is None:
                rest.append(req_id)
            elif root_id in self.groups:
                self._drop(self.groups[root_id])
        return rest

    def _park_reported_beams(self) -> None:
        """Beams that reported wait, holding blocks, for beams of their group that were preempted;
        when nothing else can run, those cannot get blocks back and the engine would wait forever.
        So free the reported beams' blocks (their tokens and reports stay with the group): their
        full blocks stay in the prefix cache, and their children start from it (fork_request)."""
        for group in self.groups.values():
            pending = [b.request for b in group.beams if b.request.request_id not in group.reports]
            if all(r.status == RequestStatus.RUNNING for r in pending):
                continue
            parked = [b.request.request_id for b in group.beams if b.request.request_id in group.reports]
            self.scheduler.finish_requests(parked, RequestStatus.FINISHED_STOPPED)

    # ---- one step of one group ---------------------------------------------------------------
    def _step(self, group: BeamGroup) -> bool:
        """HF's beam step for one group; True when the group is done."""
        k, num_candidates = group.num_beams, group.num_candidates
        cand_beam, cand_token, cand_entry, parent_scores, token_lps = [], [], [], [], []
        for j, beam in enumerate(group.beams):
            top = group.reports[beam.request.request_id]
            for rank, (token, lp) in enumerate(zip(top.top_ids, top.top_logprobs, strict=True), start=1):
                if lp == -math.inf:  # a token the beam's grammar forbids (structured output)
                    continue
                cand_beam.append(j)
                cand_token.append(token)
                cand_entry.append((lp, rank, top.top_ids, top.top_logprobs))
                parent_scores.append(beam.score)
                token_lps.append(lp)
        group.reports.clear()
        # float32 arithmetic, as HF's beam search does on its tensors: the same scores, ties included
        scores_f32 = np.asarray(parent_scores, dtype=np.float32) + np.asarray(token_lps, dtype=np.float32)
        scores = scores_f32.tolist()
        order = sorted(range(len(scores)), key=lambda i: (-scores[i], cand_beam[i], cand_token[i]))
        order = order[:num_candidates]
        new_len = group.prompt_len + group.num_steps + 1
        hits = [new_len >= group.max_length or cand_token[i] in group.stop_ids for i in order]

        # Finished: only among the top k candidates, unless no improvement is possible or (with
        # early_stopping=True) k beams have already finished.
        full = len(group.finished) == k
        if group.improvable and not (full and group.params.early_stopping is True):
            divisor = np.float32((new_len - group.prompt_len) ** group.params.length_penalty)
            normalized = (scores_f32 / divisor).tolist()
            for rank, i in enumerate(order[:k]):
                if hits[rank]:
                    beam = group.beams[cand_beam[i]]
                    group.finished.append(_Hypothesis(
                        normalized[i], beam.request.output_token_ids + [cand_token[i]],
                        beam.logprobs + [self._entry(group, cand_token[i], cand_entry[i])]))
            group.finished.sort(key=lambda h: -h.score)  # stable: earlier finished first on ties
            del group.finished[k:]

        # Running: the k best candidates that did not finish.
        chosen = [i for i, hit in zip(order, hits, strict=True) if not hit][:k]
        group.num_steps += 1
        if chosen:
            self._update_improvable(group, scores[chosen[0]], new_len)
        done = not group.improvable or all(hits) or not chosen or \
            (len(group.finished) == k and group.params.early_stopping is True)
        if not done:
            self._fork_beams(group, [(cand_beam[i], cand_token[i], scores[i], cand_entry[i]) for i in chosen])
        return done

    @staticmethod
    def _update_improvable(group: BeamGroup, best_running: float, cur_len: int) -> None:
        """HF's _check_early_stop_heuristic: can the best running beam still beat the worst
        finished one (once k have finished)?"""
        if len(group.finished) < group.num_beams:
            return
        lp = group.params.length_penalty
        if group.params.early_stopping == "never" and lp > 0.0:
            best_len = group.max_length - group.prompt_len
        else:
            best_len = cur_len - group.prompt_len
        best_possible = float(np.float32(best_running) / np.float32(best_len ** lp))
        worst_finished = min(h.score for h in group.finished)
        group.improvable = group.improvable and best_possible > worst_finished

    def _fork_beams(self, group: BeamGroup, chosen: list[tuple[int, int, float, tuple]]) -> None:
        """The next beams fork from their parents; then the old beams are dropped."""
        old = group.beams
        group.beams = []
        for j, (parent_index, token, score, entry) in enumerate(chosen):
            parent = old[parent_index].request
            child = Request(EngineCoreRequest(
                f"{group.root_id}#beam{group.num_steps}.{j}", parent.prompt_token_ids, group.beam_params,
                list(parent.eos_token_ids), parent.arrival_time, parent.priority,
                lora_request=parent.lora_request))
            child.output_token_ids = list(parent.output_token_ids)
            child.all_token_ids = list(parent.all_token_ids)
            child.append_output_token(token)
            if parent.grammar is not None:  # structured output: the beam's own matcher, one token on
                child.grammar = parent.grammar.fork()
                child.grammar.accept(token)
            self.scheduler.fork_request(parent, child)
            self._beam_group[child.request_id] = group.root_id
            group.beams.append(_Beam(child, score, old[parent_index].logprobs + [self._entry(group, token, entry)]))
        self._finish_beams(old)

    @staticmethod
    def _entry(group: BeamGroup, token: int, entry: tuple) -> TokenLogprob:
        lp, rank, top_ids, top_lps = entry
        k = group.params.logprobs or 0
        return (lp, rank, top_ids[:k], top_lps[:k])

    # ---- ending ------------------------------------------------------------------------------
    def _end(self, group: BeamGroup, finish_reason: str | None) -> list[EngineCoreOutput]:
        self._drop(group)
        num_cached = max(group.beams[0].request.num_cached_tokens, 0) if group.beams else 0
        if finish_reason == "abort":
            return [EngineCoreOutput(out_id, [], finish_reason="abort", error=group.error,
                                     num_cached_tokens=num_cached) for out_id in group.output_ids]
        best = list(group.finished)
        if len(best) < len(group.output_ids):  # cannot happen with HF's rules; keep running beams
            best += sorted((_Hypothesis(b.score, b.request.output_token_ids, b.logprobs)
                            for b in group.beams), key=lambda h: -h.score)
        outputs = []
        for out_id, hyp in zip(group.output_ids, best, strict=False):
            last = hyp.token_ids[-1] if hyp.token_ids else None
            stopped = last in group.stop_ids
            outputs.append(EngineCoreOutput(
                out_id, list(hyp.token_ids), finish_reason="stop" if stopped else "length",
                stop_reason=last if stopped and last in (group.params.stop_token_ids or ()) else None,
                new_logprobs=list(hyp.logprobs), num_cached_tokens=num_cached))
        return outputs

    def _drop(self, group: BeamGroup) -> None:
        """Forget the group and free its running beams' blocks."""
        self.groups.pop(group.root_id, None)
        self._finish_beams(group.beams)
        for out_id in group.output_ids:
            self._output_group.pop(out_id, None)

    def _finish_beams(self, beams: list[_Beam]) -> None:
        ids = [b.request.request_id for b in beams]
        for req_id in ids:
            self._beam_group.pop(req_id, None)
        self.scheduler.finish_requests(ids, RequestStatus.FINISHED_STOPPED)

    # ---- setup -------------------------------------------------------------------------------
    def _new_group(self, core_request: EngineCoreRequest) -> BeamGroup:
        params = core_request.sampling_params
        prompt_len = len(core_request.prompt_token_ids)
        max_tokens = params.max_tokens if params.max_tokens is not None else 1 << 62
        stop_ids = frozenset(params.all_stop_token_ids)
        group = BeamGroup(
            root_id=core_request.request_id, output_ids=[core_request.request_id], params=params,
            beam_params=params, prompt_len=prompt_len,
            max_length=min(prompt_len + max_tokens, self.scheduler.max_model_len), stop_ids=stop_ids)
        beam_params = params.clone(n=1, beam_width=None, temperature=0.0, logprobs=None,
                                   prompt_logprobs=None)
        beam_params.logprobs = group.num_candidates  # may exceed the user-facing cap of 20
        group.beam_params = beam_params
        return group
