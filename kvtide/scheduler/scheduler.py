"""Scheduler: iteration-level continuous batching with a token budget.

Each step:
  1. running requests first, in order: each gets min(tokens it lacks, budget) new tokens; when the
     pool is short, the lowest-priority running request (the newest, under FCFS) is preempted by
     recompute until the allocation fits;
  2. then, if nothing was preempted, waiting requests in policy order: prefix hits are taken, and
     the rest of the prompt is scheduled in a chunk that fits the budget.
Prefill chunks, decodes and recomputation after preemption all go through the same path.
"""

from __future__ import annotations

import heapq
import itertools
from collections import deque
from collections.abc import Iterable

from kvtide.config import CacheConfig, SchedulerConfig
from kvtide.engine.messages import EngineCoreOutput, SchedulerStats
from kvtide.engine.request import Request, RequestStatus
from kvtide.kv_cache.manager import KVCacheManager, cdiv
from kvtide.scheduler.output import (CachedRequestData, ModelRunnerOutput, NewRequestData,
                                     SchedulerOutput, TopLogprobs)


class WaitingQueue:
    """FCFS (a deque; preempted requests return to the front) or priority (a heap on
    (priority, arrival))."""

    def __init__(self, policy: str) -> None:
        if policy not in ("fcfs", "priority"):
            raise ValueError(f"scheduling policy must be 'fcfs' or 'priority', got {policy!r}")
        self.policy = policy
        self._deque: deque[Request] = deque()
        self._heap: list[tuple[int, float, int, Request]] = []
        self._counter = itertools.count()

    def __len__(self) -> int:
        return len(self._deque) if self.policy == "fcfs" else len(self._heap)

    def __iter__(self):
        if self.policy == "fcfs":
            return iter(self._deque)
        return (item[-1] for item in sorted(self._heap))

    def add(self, request: Request) -> None:
        if self.policy == "fcfs":
            self._deque.append(request)
        else:
            heapq.heappush(self._heap, (*request.sort_key(), next(self._counter), request))

    def add_front(self, request: Request) -> None:
        if self.policy == "fcfs":
            self._deque.appendleft(request)
        else:
            self.add(request)

    def peek(self) -> Request:
        return self._deque[0] if self.policy == "fcfs" else self._heap[0][-1]

    def pop(self) -> Request:
        return self._deque.popleft() if self.policy == "fcfs" else heapq.heappop(self._heap)[-1]

    def remove(self, requests: set[Request]) -> None:
        if self.policy == "fcfs":
            self._deque = deque(r for r in self._deque if r not in requests)
        else:
            self._heap = [item for item in self._heap if item[-1] not in requests]
            heapq.heapify(self._heap)


class Scheduler:
    def __init__(self, scheduler_config: SchedulerConfig, cache_config: CacheConfig,
                 max_model_len: int) -> None:
        self.config = scheduler_config
        self.max_model_len = max_model_len
        self.block_size = cache_config.block_size
        self.kv_cache_manager = KVCacheManager(cache_config.num_blocks, cache_config.block_size,
                                               cache_config.enable_prefix_caching,
                                               cache_config.prefix_caching_hash_algo)
        self.requests: dict[str, Request] = {}
        self.waiting = WaitingQueue(scheduler_config.policy)
        self.running: list[Request] = []
        self._finished_req_ids: set[str] = set()
        self.num_preemptions = 0

    # ---- admission -------------------------------------------------------------------------
    def check_request(self, request: Request) -> None:
        """Raise ValueError, before any state changes, if the request can never run."""
        if request.request_id in self.requests:
            raise ValueError(f"request_id {request.request_id!r} is already in use")
        longest = min(request.num_prompt_tokens + request.max_tokens, self.max_model_len)
        needed = cdiv(longest, self.block_size)
        if needed > self.kv_cache_manager.num_blocks:
            raise ValueError(
                f"request needs up to {needed} KV blocks ({longest} tokens) but the cache holds only "
                f"{self.kv_cache_manager.num_blocks}; raise kv_cache_memory or lower max_tokens")
        if self.config.max_waiting_requests is not None and \
                len(self.waiting) >= self.config.max_waiting_requests:
            raise QueueFullError(f"waiting queue is full ({self.config.max_waiting_requests} requests)")

    def add_request(self, request: Request) -> None:
        self.check_request(request)
        self.requests[request.request_id] = request
        self.waiting.add(request)

    def finish_requests(self, request_ids: Iterable[str], status: RequestStatus) -> list[str]:
        """End requests from outside (abort, stop string). Frees their blocks now."""
        assert status.finished
        ended = [self.requests[r] for r in request_ids if r in self.requests]
        waiting = {r for r in ended if r.status in (RequestStatus.WAITING, RequestStatus.PREEMPTED)}
        if waiting:
            self.waiting.remove(waiting)
        ended_set = set(ended)
        self.running = [r for r in self.running if r not in ended_set]
        for request in ended:
            request.status = status
            self._free_request(request)
        return [r.request_id for r in ended]

    def _free_request(self, request: Request) -> None:
        self.kv_cache_manager.free(request)
        self._finished_req_ids.add(request.request_id)
        self.requests.pop(request.request_id, None)

    def has_unfinished_requests(self) -> bool:
        return bool(self.running) or len(self.waiting) > 0

    # ---- the step --------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        budget = self.config.max_num_batched_tokens
        num_scheduled: dict[str, int] = {}
        new_reqs: list[NewRequestData] = []
        cached_reqs: list[CachedRequestData] = []
        preempted = False

        scheduled_running: list[Request] = []
        remaining = list(self.running)
        while remaining and budget > 0:
            request = remaining.pop(0)
            num_new = min(request.num_tokens - request.num_computed_tokens, budget,
                          self.max_model_len - request.num_computed_tokens)
            if num_new <= 0:
                scheduled_running.append(request)
                continue
            while True:
                new_blocks = self.kv_cache_manager.allocate_slots(request, num_new)
                if new_blocks is not None:
                    break
                victim = self._pick_victim(remaining, request)
                self._preempt(victim)
                preempted = True
                if victim is request:
                    break
                remaining.remove(victim)
            if new_blocks is None:
                continue
            scheduled_running.append(request)
            num_scheduled[request.request_id] = num_new
            budget -= num_new
            cached_reqs.append(CachedRequestData(request.request_id, [b.block_id for b in new_blocks],
                                                 request.num_computed_tokens))
        self.running = scheduled_running + remaining

        if not preempted:
            budget = self._schedule_waiting(budget, num_scheduled, new_reqs)

        output = SchedulerOutput(
            scheduled_new_reqs=new_reqs,
            scheduled_cached_reqs=cached_reqs,
            num_scheduled_tokens=num_scheduled,
            total_num_scheduled_tokens=sum(num_scheduled.values()),
            finished_req_ids=self._finished_req_ids,
        )
        self._finished_req_ids = set()
        return output

    def _schedule_waiting(self, budget: int, num_scheduled: dict[str, int],
                          new_reqs: list[NewRequestData]) -> int:
        while len(self.waiting) and budget > 0 and len(self.running) < self.config.max_num_seqs:
            request = self.waiting.peek()
            hits, num_hit_tokens = self.kv_cache_manager.get_computed_blocks(request)
            num_new = request.num_tokens - num_hit_tokens
            if num_new > budget and not self.config.enable_chunked_prefill:
                break
            num_new = min(num_new, budget)
            new_blocks = self.kv_cache_manager.allocate_slots(request, num_new, hits, num_hit_tokens)
            if new_blocks is None:
                break
            self.waiting.pop()
            if request.num_cached_tokens < 0:
                request.num_cached_tokens = num_hit_tokens
            request.num_computed_tokens = num_hit_tokens
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            num_scheduled[request.request_id] = num_new
            budget -= num_new
            new_reqs.append(NewRequestData(
                request_id=request.request_id,
                token_ids=list(request.all_token_ids),
                num_prompt_tokens=request.num_prompt_tokens,
                sampling_params=request.sampling_params,
                block_ids=self.kv_cache_manager.get_block_ids(request.request_id),
                num_computed_tokens=num_hit_tokens,
                num_output_tokens=request.num_output_tokens,
            ))
        return budget

    def _pick_victim(self, candidates: list[Request], current: Request) -> Request:
        """The request to preempt: lowest priority, newest arrival, among those not yet scheduled
        this step (or the current one itself)."""
        pool = candidates + [current]
        if self.config.policy == "priority":
            return max(pool, key=Request.sort_key)
        return candidates[-1] if candidates else current

    def _preempt(self, request: Request) -> None:
        self.kv_cache_manager.free(request)
        self._finished_req_ids.add(request.request_id)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.add_front(request)

    # ---- after the forward pass ------------------------------------------------------------
    def update_from_output(self, scheduler_output: SchedulerOutput,
                           runner_output: ModelRunnerOutput) -> list[EngineCoreOutput]:
        outputs: list[EngineCoreOutput] = []
        stopped: list[Request] = []
        for req_id, num_tokens in scheduler_output.num_scheduled_tokens.items():
            request = self.requests.get(req_id)
            if request is None:  # aborted while the step ran
                continue
            request.num_computed_tokens += num_tokens
            out = EngineCoreOutput(req_id, [], num_cached_tokens=max(request.num_cached_tokens, 0))
            if req_id in runner_output.prompt_logprobs:
                out.new_prompt_logprobs = [_as_tuple(t) for t in runner_output.prompt_logprobs[req_id]]
            if req_id in runner_output.failed:
                request.status = RequestStatus.FINISHED_ABORTED
                out.finish_reason, out.error = "abort", runner_output.failed[req_id]
                stopped.append(request)
                outputs.append(out)
                continue
            token_id = runner_output.sampled_token_ids.get(req_id)
            if token_id is not None:
                request.append_output_token(token_id)
                out.new_token_ids.append(token_id)
                if req_id in runner_output.logprobs:
                    out.new_logprobs = [_as_tuple(runner_output.logprobs[req_id])]
                if self._check_stop(request):
                    out.finish_reason = request.status.finish_reason
                    out.stop_reason = request.stop_reason
                    stopped.append(request)
            if out.new_token_ids or out.finished or out.new_prompt_logprobs:
                outputs.append(out)
        if stopped:
            stopped_set = set(stopped)
            self.running = [r for r in self.running if r not in stopped_set]
            for request in stopped:
                self._free_request(request)
        return outputs

    def _check_stop(self, request: Request) -> bool:
        params = request.sampling_params
        token_id = request.output_token_ids[-1]
        if request.num_output_tokens >= params.min_tokens:
            if not params.ignore_eos and token_id in request.eos_token_ids:
                request.status = RequestStatus.FINISHED_STOPPED
                return True
            if token_id in (params.stop_token_ids or ()):
                request.status = RequestStatus.FINISHED_STOPPED
                request.stop_reason = token_id
                return True
        if request.num_output_tokens >= request.max_tokens or request.num_tokens >= self.max_model_len:
            request.status = RequestStatus.FINISHED_LENGTH
            return True
        return False

    def get_stats(self) -> SchedulerStats:
        pool = self.kv_cache_manager.pool
        prefix = self.kv_cache_manager.prefix_stats
        return SchedulerStats(
            num_running=len(self.running), num_waiting=len(self.waiting),
            kv_cache_usage=pool.usage(), num_preemptions=self.num_preemptions,
            prefix_cache_queries=prefix.queries, prefix_cache_hits=prefix.hits,
            num_used_blocks=pool.num_used_blocks, num_evictable_blocks=pool.num_evictable_blocks,
            num_blocks=pool.num_blocks)


class QueueFullError(ValueError):
    """The waiting queue is at --max-waiting-requests (the server answers 429)."""


def _as_tuple(t: TopLogprobs) -> tuple[float, int, list[int], list[float]]:
    return (t.token_logprob, t.token_rank, t.top_ids, t.top_logprobs)
