"""Scheduler: iteration-level continuous batching with a token budget.

Each step:
  1. running requests first, in admission order (priority order under 'priority'): each gets
     min(tokens it lacks, budget) new tokens; when the pool is short, the lowest-priority running
     request (the newest, under FCFS) is preempted by recompute until the allocation fits;
  2. then, if nothing was preempted, waiting requests in policy order: prefix hits are taken, and
     the rest of the prompt is scheduled in a chunk that fits the budget.
Prefill chunks, decodes and recomputation after preemption all go through the same path.

Speculative decoding: a decoding request may get 1 + k tokens, its last token and k draft slots
(the runner fills them with a proposer's drafts and verifies all k + 1 in one pass). The drafts'
KV slots are allocated like any others; when the runner reports how many were accepted,
num_computed_tokens rolls back over the rejected ones, whose slots the next step overwrites.
Drafts never enter the request's token ids until accepted, so a block holding unverified tokens
is never published to the prefix cache. k comes from the adaptive policy (spec_decode/policy.py).

Structured output: a constrained request waits in the queue until its grammar has compiled
(structured_output/manager.py); each step hands the runner the matchers of the constrained
requests that sample (SchedulerOutput.grammar), and every emitted token advances the request's
matcher. Where the grammar then forces a continuation, those tokens are appended at once
(jump-forward) and computed with the next step like a short prefill chunk.

KV connectors (disagg/): a waiting request's prompt past its device prefix hit may exist outside
the device (host memory, Redis, a prefill instance). The connector's scheduler half says how many
tokens; they get blocks like the hits and count as computed, and the worker half loads them before
the step's forward. A request whose KV is still in transit keeps its place in the queue. A finished
request the connector is handing on keeps its blocks until the worker has copied them out.

Forks: a request naming `fork_of` (the n > 1 / best_of siblings) is held until that sibling has
computed the prompt, then shares its blocks (KVCacheManager.fork) and computes only the last prompt
token; `fork_request` is also the hook beam search uses for its beams.
"""

from __future__ import annotations

from collections.abc import Iterable

from kvtide.config import CacheConfig, SchedulerConfig
from kvtide.engine.expert_load import ExpertLoadStats
from kvtide.engine.messages import (
    EngineCoreOutput,
    SchedulerStats,
    new_iteration_tokens,
    observe_iteration_tokens,
)
from kvtide.engine.request import Request, RequestStatus
from kvtide.kv_cache.hybrid import HybridKVCacheManager
from kvtide.kv_cache.manager import KVCacheManager
from kvtide.scheduler.output import (
    CachedRequestData,
    ModelRunnerOutput,
    NewRequestData,
    SchedulerOutput,
    TopLogprobs,
)
from kvtide.scheduler.waiting_queue import WaitingQueue
from kvtide.spec_decode.metrics import SpecDecodingStats
from kvtide.spec_decode.policy import AcceptanceStats, SpecDecodePolicy


class Scheduler:
    def __init__(self, scheduler_config: SchedulerConfig, cache_config: CacheConfig,
                 max_model_len: int, spec_policy: SpecDecodePolicy | None = None,
                 structured_output=None, kv_connector=None) -> None:
        self.config = scheduler_config
        self.spec_policy = spec_policy
        self.structured_output = structured_output
        """A StructuredOutputManager (compiles grammars, makes matchers), or None."""
        self._grammar_failures: list[EngineCoreOutput] = []
        """Requests ended because their grammar did not compile, reported with the next outputs."""
        self.spec_stats = SpecDecodingStats(spec_policy.config.num_speculative_tokens if spec_policy else 0)
        self.expert_load: ExpertLoadStats | None = None
        """MoE models: assignments per sparse layer and expert so far (from the runner's reports)."""
        self.max_model_len = max_model_len
        self.block_size = cache_config.block_size
        self.kv_cache_manager: KVCacheManager | HybridKVCacheManager
        if cache_config.kv_cache_groups:  # full and windowed layers: a table per layer group
            self.kv_cache_manager = HybridKVCacheManager(cache_config.kv_cache_groups, cache_config.num_blocks,
                                                         cache_config.block_size, cache_config.enable_prefix_caching,
                                                         cache_config.prefix_caching_hash_algo)
        else:
            self.kv_cache_manager = KVCacheManager(cache_config.num_blocks, cache_config.block_size,
                                                   cache_config.enable_prefix_caching,
                                                   cache_config.prefix_caching_hash_algo,
                                                   sliding_window=cache_config.sliding_window,
                                                   sink_tokens=cache_config.kv_sink_tokens,
                                                   drop_budget=cache_config.kv_drop_budget
                                                   if cache_config.kv_drop_policy == "score" else None)
        self.kv_connector = kv_connector
        """The scheduler half of a KV connector (disagg/base.py), or None."""
        self._kept_for_connector: dict[str, Request] = {}
        """Finished requests whose blocks stay until the connector's worker half has copied them."""
        if kv_connector is not None:
            kv_connector.bind(self.kv_cache_manager)
            if kv_connector.wants_evictions:
                self.kv_cache_manager.pool.evict_listener = kv_connector.block_evicted
        self.requests: dict[str, Request] = {}
        self.waiting = WaitingQueue(scheduler_config.policy)
        self.running: list[Request] = []
        self.pipeline_depth = 1
        """Pipeline parallelism (> 1): a request whose sampled token is still in flight is not
        scheduled again until it is reported (earlier stages cannot compute a step on a token they
        lack), and a step takes about 1/depth of the requests, so that `depth` micro-batches keep
        every stage busy."""
        self._finished_req_ids: set[str] = set()
        self._num_prompt_logprobs_sent: dict[str, int] = {}
        """request id -> prompt positions whose logprobs went out (a preempted request computes its
        prompt again; those must not go out twice)."""
        self.num_preemptions = 0
        self.iteration_tokens = new_iteration_tokens()
        """Tokens each step scheduled (SchedulerStats.iteration_tokens)."""
        self._pending_forks: dict[str, list[Request]] = {}
        """parent id -> requests waiting to be forked from it once its prompt is computed."""
        self._send_full: set[str] = set()
        """Running requests the runner has not seen (forked children): sent as NewRequestData."""
        self.max_loras: int | None = None
        """With LoRA: the most distinct adapters running at once (the model's slots); None: no LoRA."""
        self.lora_ready = None
        """With LoRA: LoRARequest -> whether its adapter is loaded (if not, its load starts), or None."""
        self.num_lora_loading = 0
        """Requests the last schedule() left waiting for their adapter to load."""

    # ---- admission -------------------------------------------------------------------------
    def check_request(self, request: Request) -> None:
        """Raise ValueError, before any state changes, if the request can never run."""
        if request.request_id in self.requests:
            raise ValueError(f"request_id {request.request_id!r} is already in use")
        longest = min(request.num_prompt_tokens + request.max_tokens, self.max_model_len)
        # The last sampled token ends the request before its KV is written. Under a sliding window
        # the request holds only the sinks, the window and one step's tokens at a time; no step
        # computes more than the token budget.
        num_kv_tokens = max(longest - 1, request.num_prompt_tokens)
        needed = self.kv_cache_manager.max_blocks_held(num_kv_tokens, self.config.max_num_batched_tokens)
        if needed > self.kv_cache_manager.num_blocks:
            raise ValueError(
                f"request needs up to {needed} KV blocks ({num_kv_tokens} tokens) but the cache holds only "
                f"{self.kv_cache_manager.num_blocks}; raise kv_cache_memory or lower max_tokens")
        if self.config.max_waiting_requests is not None and \
                len(self.waiting) >= self.config.max_waiting_requests:
            raise QueueFullError(f"waiting queue is full ({self.config.max_waiting_requests} requests)")
        if self.kv_connector is not None:
            self.kv_connector.check_request(request)

    def add_request(self, request: Request) -> None:
        self.check_request(request)
        if self.structured_output is not None:
            self.structured_output.add_request(request)
        self.requests[request.request_id] = request
        parent = self.requests.get(request.fork_of) if request.fork_of is not None else None
        if parent is not None and parent.num_output_tokens == 0 and not parent.is_finished():
            self._pending_forks.setdefault(parent.request_id, []).append(request)
            return
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
        for request in ended:
            self._free_request(request)
        return [r.request_id for r in ended]

    def _free_request(self, request: Request) -> dict | None:
        """Release an ended request; returns the KV connector's kv_transfer_params for it, if any."""
        params = None
        keep = False
        if self.kv_connector is not None:
            keep, params = self.kv_connector.request_finished(
                request, self.kv_cache_manager.get_block_ids(request.request_id))
        if keep:
            self._kept_for_connector[request.request_id] = request
        else:
            self.kv_cache_manager.free(request)
        self._finished_req_ids.add(request.request_id)
        self.requests.pop(request.request_id, None)
        self._send_full.discard(request.request_id)
        self._num_prompt_logprobs_sent.pop(request.request_id, None)
        self._release_pending_forks(request)
        return params

    # ---- forks -----------------------------------------------------------------------------
    def fork_request(self, parent: Request, child: Request) -> None:
        """Admit `child` as running, sharing `parent`'s computed KV blocks by reference count. A
        parent holding no blocks (preempted, or a parked beam) has nothing to share: the child
        then queues like a new request, taking what it can from the prefix cache."""
        if parent.request_id not in self.kv_cache_manager.req_to_blocks:
            child.status = RequestStatus.WAITING
            self.requests[child.request_id] = child
            self.waiting.add_front(child)
            return
        self.kv_cache_manager.fork(parent, child)
        if self.structured_output is not None:
            self.structured_output.make_ready(child)
        if child.num_cached_tokens < 0:
            child.num_cached_tokens = max(parent.num_cached_tokens, 0)
        child.status = RequestStatus.RUNNING
        self.requests[child.request_id] = child
        self.running.append(child)
        self._send_full.add(child.request_id)

    def _release_pending_forks(self, request: Request) -> None:
        """A parent that ends before its prompt is computed lets its siblings compute their own;
        a held sibling that ends leaves the hold."""
        for child in self._pending_forks.pop(request.request_id, []):
            if not child.is_finished():
                self.waiting.add(child)
        held = self._pending_forks.get(request.fork_of or "")
        if held and request in held:
            held.remove(request)

    def _send_in_full(self, cached_reqs: list[CachedRequestData], new_reqs: list[NewRequestData],
                      rewritten: set[str]) -> list[CachedRequestData]:
        """Running requests the runner must see whole (forked children it has not seen; tables
        copy-on-write rewrote) go as NewRequestData; returns the rest."""
        full = rewritten | self._send_full
        if not full:
            return cached_reqs
        kept = []
        for data in cached_reqs:
            if data.request_id in full:
                new_reqs.append(self._new_request_data(self.requests[data.request_id]))
                self._send_full.discard(data.request_id)
            else:
                kept.append(data)
        return kept

    def has_unfinished_requests(self) -> bool:
        return bool(self.running) or len(self.waiting) > 0 or bool(self._kept_for_connector) \
            or (self.kv_connector is not None and self.kv_connector.has_pending_work())

    # ---- the step --------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        budget = self.config.max_num_batched_tokens
        self.num_lora_loading = 0
        num_scheduled: dict[str, int] = {}
        new_reqs: list[NewRequestData] = []
        cached_reqs: list[CachedRequestData] = []
        preempted = False

        scheduled_running: list[Request] = []
        if self.config.policy == "priority":
            # Highest priority first: a victim (the lowest priority) is then never one already
            # scheduled this step, and the budget goes to the most urgent first.
            self.running.sort(key=Request.sort_key)
        remaining = list(self.running)
        num_drafts: dict[str, int] = {}
        speculates = self.spec_policy is not None and self.spec_policy.speculates(len(self.running))
        max_requests = -(-(len(self.running) + len(self.waiting)) // self.pipeline_depth)
        while remaining and budget > 0 and len(num_scheduled) < max_requests:
            request = remaining.pop(0)
            if self.pipeline_depth > 1 and request.num_output_placeholders:
                scheduled_running.append(request)  # its next input is the token still in flight
                continue
            num_new = min(request.num_tokens_with_placeholders - request.num_computed_tokens, budget,
                          self.max_model_len - request.num_computed_tokens)
            if num_new <= 0 or self._ends_by_length(request):
                scheduled_running.append(request)
                continue
            k = self._num_draft_tokens(request, budget) if speculates and num_new == 1 else 0
            if k:
                num_new += k
                num_drafts[request.request_id] = k
            while True:
                new_blocks = self.kv_cache_manager.allocate_slots(request, num_new)
                if new_blocks is not None:
                    break
                if request.request_id in num_drafts:  # drafts never cost another request its blocks
                    num_new -= num_drafts.pop(request.request_id)
                    continue
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
                                                 request.num_computed_tokens, request.unsent_token_ids,
                                                 self.kv_cache_manager.take_dropped(request.request_id)))
            request.unsent_token_ids = []
        self.running = scheduled_running + remaining

        if not preempted:
            budget = self._schedule_waiting(budget, num_scheduled, new_reqs, max_requests)

        block_copies, rewritten = self.kv_cache_manager.take_block_copies()
        cached_reqs = self._send_in_full(cached_reqs, new_reqs, rewritten)
        output = SchedulerOutput(
            scheduled_new_reqs=new_reqs,
            scheduled_cached_reqs=cached_reqs,
            num_scheduled_tokens=num_scheduled,
            total_num_scheduled_tokens=sum(num_scheduled.values()),
            finished_req_ids=self._finished_req_ids,
            block_copies=block_copies,
            num_computed_before={r: self.requests[r].num_computed_tokens for r in num_scheduled
                                 if self.requests[r].sampling_params.prompt_logprobs is not None},
            num_draft_tokens=num_drafts,
        )
        self._finished_req_ids = set()
        if output.total_num_scheduled_tokens:
            observe_iteration_tokens(self.iteration_tokens, output.total_num_scheduled_tokens)
        for req_id, num_new in num_scheduled.items():
            request = self.requests[req_id]
            request.num_computed_tokens += num_new
            if request.num_computed_tokens >= request.num_tokens_with_placeholders:
                # The runner samples here; until that token is reported it counts as known.
                request.num_output_placeholders += 1
                output.sampling_req_ids.add(req_id)
        if self.kv_connector is not None:
            output.kv_connector_metadata = self.kv_connector.build_connector_meta(output, self.requests)
        if self.structured_output is not None and self.structured_output.stats.num_constrained_requests:
            output.grammar = self.structured_output.grammar_step(
                [self.requests[r] for r in output.sampling_req_ids])
        return output

    def _num_draft_tokens(self, request: Request, budget: int) -> int:
        """Draft slots for a decoding request: the policy's choice, capped by the step's budget and
        by what the request may still emit (max_tokens, max_model_len)."""
        params = request.sampling_params
        if (not params.speculation or params.use_beam_search or request.num_output_placeholders
                or request.num_output_tokens == 0):
            return 0
        assert self.spec_policy is not None
        if request.spec_stats is None:
            request.spec_stats = AcceptanceStats()
        k = self.spec_policy.num_draft_tokens(request.spec_stats)
        return max(min(k, budget - 1, request.max_tokens - request.num_output_tokens - 1,
                       self.max_model_len - request.num_tokens - 1), 0)

    def _ends_by_length(self, request: Request) -> bool:
        """Whether the tokens still to be reported finish the request by length: a step scheduled
        ahead of them would be wasted."""
        if not request.num_output_placeholders:
            return False
        return (request.num_output_tokens + request.num_output_placeholders >= request.max_tokens
                or request.num_tokens_with_placeholders >= self.max_model_len)

    def can_schedule_ahead(self) -> bool:
        """Whether the next step may be scheduled before the pending one reports: not while a fork
        waits for its parent's first token (it must share the blocks as they are then), nor while a
        constrained request runs (its next mask follows from the token being sampled)."""
        return not self._pending_forks and not any(r.grammar is not None for r in self.running)

    def _schedule_waiting(self, budget: int, num_scheduled: dict[str, int],
                          new_reqs: list[NewRequestData], max_requests: int) -> int:
        compiling: list[Request] = []
        """Requests whose grammar is still compiling: they keep their place in the queue."""
        in_transit: list[Request] = []
        """Requests whose KV a connector is still receiving: likewise."""
        while len(self.waiting) and budget > 0 and len(self.running) < self.config.max_num_seqs \
                and len(num_scheduled) < max_requests:
            request = self.waiting.peek()
            if request.num_output_placeholders:  # preempted with a token still to be reported
                break
            if self.structured_output is not None and not self.structured_output.is_ready(request):
                compiling.append(self.waiting.pop())
                continue
            if request.grammar_error is not None:
                self.waiting.pop()
                self._fail_grammar(request)
                continue
            if not self._lora_slot_free(request):  # its adapter waits for a slot: it keeps its place
                compiling.append(self.waiting.pop())
                continue
            hits, num_hit_tokens = self.kv_cache_manager.get_computed_blocks(request)
            num_external = 0
            if self.kv_connector is not None:
                num_external = self.kv_connector.get_num_new_matched_tokens(request, num_hit_tokens)
                if num_external is None:  # its KV is in transit: it keeps its place, others go first
                    in_transit.append(self.waiting.pop())
                    continue
            num_new = request.num_tokens - num_hit_tokens - num_external
            if num_new > budget and not self.config.enable_chunked_prefill:
                break
            num_new = min(num_new, budget)
            new_blocks = self.kv_cache_manager.allocate_slots(request, num_new + num_external, hits, num_hit_tokens)
            if new_blocks is None:
                break
            self.waiting.pop()
            if request.num_cached_tokens < 0:
                request.num_cached_tokens = num_hit_tokens + num_external
            request.num_computed_tokens = num_hit_tokens
            if self.kv_connector is not None:
                self.kv_connector.update_state_after_alloc(request, num_external)
                request.num_computed_tokens += num_external
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            num_scheduled[request.request_id] = num_new
            budget -= num_new
            self._send_full.discard(request.request_id)
            new_reqs.append(self._new_request_data(request))
        for request in reversed(compiling + in_transit):
            self.waiting.add_front(request)
        return budget

    def _lora_slot_free(self, request: Request) -> bool:
        """Whether `request` may run beside the running ones: its adapter is among theirs, or they
        use fewer than max_loras adapters (the model holds that many at once); and its adapter is
        loaded (`lora_ready` starts the load of one that is not, which the queue waits for)."""
        if request.lora_request is None or self.max_loras is None:
            return True
        running = {r.lora_request.lora_int_id for r in self.running if r.lora_request is not None}
        if request.lora_request.lora_int_id not in running and len(running) >= self.max_loras:
            return False
        if self.lora_ready is not None and not self.lora_ready(request.lora_request):
            self.num_lora_loading += 1
            return False
        return True

    def _fail_grammar(self, request: Request) -> None:
        request.status = RequestStatus.FINISHED_ABORTED
        self._grammar_failures.append(EngineCoreOutput(request.request_id, [], finish_reason="abort",
                                                       error=request.grammar_error,
                                                       error_status=request.grammar_error_status))
        self._free_request(request)

    def has_compiling_requests(self) -> bool:
        return any(r.grammar_future is not None for r in self.waiting)

    def _new_request_data(self, request: Request) -> NewRequestData:
        request.unsent_token_ids = []  # the runner gets every token
        return NewRequestData(
            request_id=request.request_id,
            token_ids=list(request.all_token_ids),
            num_prompt_tokens=request.num_prompt_tokens,
            sampling_params=request.sampling_params,
            block_ids=self.kv_cache_manager.get_block_ids(request.request_id),
            num_computed_tokens=request.num_computed_tokens,
            num_output_tokens=request.num_output_tokens,
            lora_request=request.lora_request,
            pooling_params=request.pooling_params,
        )

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
        outputs, self._grammar_failures = self._grammar_failures, []
        if self.kv_connector is not None:
            for req_id in self.kv_connector.update_connector_output(runner_output.kv_connector_output):
                request = self._kept_for_connector.pop(req_id, None)
                if request is not None:
                    self.kv_cache_manager.free(request)
        for req_id, mass in runner_output.kv_block_mass.items():  # the score drop policy's history
            self.kv_cache_manager.add_block_mass(req_id, mass)
        load = runner_output.expert_load
        if load is not None:
            if self.expert_load is None:
                self.expert_load = ExpertLoadStats(load["layers"], len(load["tokens"][0]))
            self.expert_load.add(load["tokens"], load["dropped"])
        stopped: list[Request] = []
        requeued: set[Request] = set()
        """Preempted after this step was scheduled ahead (they wait to recompute)."""
        for req_id in scheduler_output.num_scheduled_tokens:
            request = self.requests.get(req_id)
            if request is None:  # ended while the step ran
                continue
            if request.status == RequestStatus.PREEMPTED:
                requeued.add(request)
            out = EngineCoreOutput(req_id, [], num_cached_tokens=max(request.num_cached_tokens, 0))
            if req_id in runner_output.prompt_logprobs:
                out.new_prompt_logprobs = self._unsent_prompt_logprobs(
                    request, scheduler_output.num_computed_before[req_id], runner_output.prompt_logprobs[req_id])
            if req_id in scheduler_output.sampling_req_ids:
                request.num_output_placeholders -= 1
            if req_id in runner_output.failed:
                request.status = RequestStatus.FINISHED_ABORTED
                out.finish_reason, out.error = "abort", runner_output.failed[req_id]
                stopped.append(request)
                outputs.append(out)
                continue
            pooled = runner_output.pooler_output.get(req_id)
            if pooled is not None:  # a pooling request ends with its prompt: no token, no decode
                request.status = RequestStatus.FINISHED_STOPPED
                out.finish_reason, out.pooling_output = "stop", pooled
                stopped.append(request)
                outputs.append(out)
                continue
            token_id = runner_output.sampled_token_ids.get(req_id)
            if token_id is not None:
                accepted = runner_output.spec_token_ids.get(req_id, [])
                if req_id in scheduler_output.num_draft_tokens:
                    self._account_drafts(request, scheduler_output.num_draft_tokens[req_id],
                                         runner_output.num_draft_tokens.get(req_id, 0), len(accepted))
                logprobs = (runner_output.spec_logprobs.get(req_id) or [None] * len(accepted)) \
                    + [runner_output.logprobs.get(req_id)]
                for token, entry in zip(accepted + [token_id], logprobs, strict=True):
                    request.append_output_token(token)
                    out.new_token_ids.append(token)
                    if entry is not None:
                        out.new_logprobs = (out.new_logprobs or []) + [_as_tuple(entry)]
                    if self._check_stop(request) or (request.grammar is not None
                                                     and self._check_grammar(request, out)):
                        # a stop inside an accepted run drops the rest
                        out.finish_reason = request.status.finish_reason
                        out.stop_reason = request.stop_reason
                        stopped.append(request)
                        break
                else:
                    if request.grammar is not None and self._jump_forward(request, out):
                        out.finish_reason = request.status.finish_reason
                        out.stop_reason = request.stop_reason
                        stopped.append(request)
                if req_id in self._pending_forks:  # the prompt is computed: siblings share it
                    for child in self._pending_forks.pop(req_id):
                        self.fork_request(request, child)
            if out.new_token_ids or out.finished or out.new_prompt_logprobs:
                outputs.append(out)
        if stopped:
            stopped_set = set(stopped)
            self.running = [r for r in self.running if r not in stopped_set]
            if requeued & stopped_set:
                self.waiting.remove(requeued & stopped_set)
            finals = {out.request_id: out for out in outputs if out.finished}
            for request in stopped:
                params = self._free_request(request)
                if params is not None and request.request_id in finals:
                    finals[request.request_id].kv_transfer_params = params
        return outputs

    def _check_grammar(self, request: Request, out: EngineCoreOutput) -> bool:
        """After an emitted token: advance the request's matcher. Ends the request (True) when the
        grammar completed, or, which masking rules out, when it forbids the token."""
        if not request.grammar.accept(request.output_token_ids[-1]):
            request.status = RequestStatus.FINISHED_ABORTED
            out.error = f"token {request.output_token_ids[-1]} is not allowed by the request's grammar"
            return True
        if request.grammar.is_terminated:
            request.status = RequestStatus.FINISHED_STOPPED
            return True
        return False

    def _jump_forward(self, request: Request, out: EngineCoreOutput) -> bool:
        """Append the tokens the grammar forces after this step's tokens; True if one ends the
        request (max_tokens, max_model_len, a stop token id)."""
        if self.structured_output is None or not self.structured_output.jump_forward_for(request):
            return False
        limit = min(request.max_tokens - request.num_output_tokens, self.max_model_len - request.num_tokens)
        for token in request.grammar.jump_forward_tokens(limit):
            request.append_output_token(token)
            request.unsent_token_ids.append(token)
            out.new_token_ids.append(token)
            self.structured_output.stats.num_jump_forward_tokens += 1
            if self._check_stop(request):
                return True
        return False

    def _account_drafts(self, request: Request, num_slots: int, num_drafted: int, num_accepted: int) -> None:
        """After a verification step: roll num_computed_tokens back over the rejected slots (those of
        drafts the proposer did not fill included), and count the drafts for the metrics and the
        request's acceptance estimate."""
        request.num_computed_tokens -= num_slots - num_accepted
        if num_drafted:
            self.spec_stats.observe(num_drafted, num_accepted)
            assert request.spec_stats is not None
            request.spec_stats.observe(num_drafted, num_accepted)

    def _unsent_prompt_logprobs(self, request: Request, start: int, entries: list[TopLogprobs]
                                ) -> list[tuple[float, int, list[int], list[float]]] | None:
        """This step's prompt logprobs (one per position from `start`, where the step started)
        minus the positions sent before a preemption."""
        sent = self._num_prompt_logprobs_sent.get(request.request_id, 0)
        self._num_prompt_logprobs_sent[request.request_id] = max(sent, start + len(entries))
        return [_as_tuple(t) for t in entries[max(sent - start, 0):]] or None

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
            num_blocks=pool.num_blocks, max_num_seqs=self.config.max_num_seqs,
            max_num_batched_tokens=self.config.max_num_batched_tokens,
            iteration_tokens={**self.iteration_tokens, "counts": list(self.iteration_tokens["counts"])},
            spec_decoding=self.spec_stats.as_dict() if self.spec_policy else None,
            expert_load=self.expert_load.as_dict() if self.expert_load is not None else None,
            structured_output=self.structured_output.stats.as_dict()
            if self.structured_output is not None and self.structured_output.stats.num_constrained_requests else None,
            kv_connector=self.kv_connector.stats.as_dict() if self.kv_connector is not None else None)


class QueueFullError(ValueError):
    """The waiting queue is at --max-waiting-requests (the server answers 429)."""


def _as_tuple(t: TopLogprobs) -> tuple[float, int, list[int], list[float]]:
    return (t.token_logprob, t.token_rank, t.top_ids, t.top_logprobs)
