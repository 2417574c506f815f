"""EngineCore: the loop that owns the scheduler and drives the executor.

    step():  scheduler.schedule() -> executor.execute() -> scheduler.update_from_output()

With async scheduling the executor runs on a worker thread, one step behind the scheduler:

    main:    schedule N+1 | wait for N | update from N, return N's outputs | schedule N+2 | ...
    worker:  ... execute N ............| execute N+1 ..............................| ...

so scheduling and output processing overlap the forward pass. The scheduler counts each pending
step's sampled tokens as placeholders (the runner feeds them back itself); a request that ends in
step N had one more token computed in N+1, which is dropped. A step whose outcome the next one
depends on (a fork waiting for its parent's first token, beam search) is waited for first.

Beam search plugs in around the step (engine/beam_search.py): it takes its beams' rows out of the
runner output before the scheduler sees them, then forks and drops beams.

The same class runs in-process (offline LLM) or inside the engine-core process (server).
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Protocol

from kvtide.config import EngineConfig
from kvtide.engine.beam_search import BeamSearch
from kvtide.engine.expert_load import summarize as summarize_expert_load
from kvtide.engine.messages import EngineCoreOutput, SchedulerStats
from kvtide.engine.request import EngineCoreRequest, Request, RequestStatus
from kvtide.kv_events.events import KVEventRecorder
from kvtide.kv_events.publisher import KVEventPublisher
from kvtide.lora.stats import lora_stats
from kvtide.scheduler.output import ModelRunnerOutput, SchedulerOutput
from kvtide.scheduler.scheduler import Scheduler
from kvtide.spec_decode.metrics import difference, summarize
from kvtide.spec_decode.policy import SpecDecodePolicy
from kvtide.structured_output.manager import StructuredOutputManager

logger = logging.getLogger(__name__)

SPEC_LOG_INTERVAL_S = 10.0
EXPERT_LOAD_LOG_INTERVAL_S = 10.0
LORA_LOG_INTERVAL_S = 10.0


class Executor(Protocol):
    def execute(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput: ...
    def shutdown(self) -> None: ...


class EngineCore:
    def __init__(self, config: EngineConfig, executor: Executor,
                 load_tokenizer: Callable[[], Any] | None = None, kv_connector=None,
                 data_parallel_rank: int | None = None) -> None:
        self.config = config
        self.executor = executor
        self.kv_connector = kv_connector
        """Both halves of a KV connector (disagg/base.py): the scheduler's here, the runner's bound to it."""
        spec = config.speculative_config
        self.structured_output = StructuredOutputManager(
            load_tokenizer or _no_tokenizer, getattr(config.model_config.hf_config, "vocab_size", 0),
            config.structured_outputs_config.enable_jump_forward, config.structured_outputs_config)
        self.scheduler = Scheduler(config.scheduler_config, config.cache_config,
                                   config.model_config.max_model_len,
                                   SpecDecodePolicy(spec, spec.draft_cost or 0.0) if spec is not None else None,
                                   self.structured_output,
                                   kv_connector.scheduler if kv_connector is not None else None)
        if config.lora_config is not None:
            self.scheduler.max_loras = config.lora_config.max_loras
            self.scheduler.lora_ready = getattr(executor, "lora_prefetch", None)
        self._loras_to_remove: set[int] = set()
        """LoRA adapters unloaded while requests still ran with them: removed once those finish."""
        self._lora_names: dict[int, str] = {}
        """lora_int_id -> name of the adapters loaded (for stats and the log)."""
        self._lora_logged = time.monotonic()
        self._spec_logged: tuple[float, dict | None] = (time.monotonic(), None)
        self._expert_load_logged: tuple[float, dict | None] = (time.monotonic(), None)
        """When the speculative decoding line was last logged, and the counters then."""
        self.beam_search = BeamSearch(self.scheduler)
        self.num_steps = 0
        self._worker: ThreadPoolExecutor | None = None
        self._pipeline_depth = config.parallel_config.pipeline_parallel_size
        self._batch_queue: deque[tuple[SchedulerOutput, Callable[[], ModelRunnerOutput]]] | None = None
        """Pipeline parallelism: micro-batches in flight, oldest first (at most one per stage)."""
        if self._pipeline_depth > 1:
            self._batch_queue = deque()
            self.scheduler.pipeline_depth = self._pipeline_depth
        elif config.scheduler_config.async_scheduling:
            self._worker = ThreadPoolExecutor(1, "kvtide-step",
                                              initializer=getattr(executor, "init_worker_thread", None))
        self._pending: tuple[SchedulerOutput, Future[ModelRunnerOutput]] | None = None
        """The step running on the worker whose outputs are not processed yet."""
        self.sleep_level = 0
        """0 awake; 1 or 2 while asleep (worker/sleep_mode.py)."""
        self.kv_events: KVEventPublisher | None = None
        self._kv_event_recorder: KVEventRecorder | None = None
        if config.kv_events_config is not None:
            self._kv_event_recorder = KVEventRecorder()
            self.kv_events = KVEventPublisher(config.kv_events_config, data_parallel_rank)
            self.scheduler.kv_cache_manager.pool.event_sink = self._kv_event_recorder
        self.memory: dict[str, int] | None = None
        """Bytes by kind measured at startup (weights as stored and held, packed copies, KV pool,
        runtime; worker/memory_budget.py), reported in the stats; None if not measured."""

    def add_request(self, core_request: EngineCoreRequest) -> None:
        """Admit a request; ValueError (nothing changed) if it can never run."""
        if self.sleep_level:
            raise ValueError(f"the engine is asleep (level {self.sleep_level}): wake_up() first")
        self._check_runner(core_request)
        if not self.beam_search.add_request(core_request):
            self.scheduler.add_request(Request(core_request))

    def check_request(self, core_request: EngineCoreRequest) -> None:
        self._check_runner(core_request)
        self.scheduler.check_request(Request(core_request))

    def _check_runner(self, core_request: EngineCoreRequest) -> None:
        """A pooling model (kvtide/pooling/) takes pooling requests only, a generation model none."""
        pooling_model = getattr(self.config.model_config, "pooler_config", None) is not None
        if pooling_model and core_request.pooling_params is None:
            raise ValueError("this is a pooling model: it embeds, classifies and scores (LLM.embed, classify, "
                             "score; /v1/embeddings, /classify, /score, /rerank) but does not generate")
        if not pooling_model and core_request.pooling_params is not None:
            raise ValueError("this is a generation model: pooling requests need a pooling model (--runner pooling)")

    def abort_requests(self, request_ids: list[str]) -> None:
        request_ids = self.beam_search.abort(request_ids)
        for request_id in request_ids:  # a grammar compile nobody waits for any more is cancelled
            request = self.scheduler.requests.get(request_id)
            if request is not None:
                self.structured_output.remove_request(request)
        self.scheduler.finish_requests(request_ids, RequestStatus.FINISHED_ABORTED)

    def stop_requests(self, request_ids: list[str]) -> None:
        """End requests that the output side found finished (a stop string)."""
        self.scheduler.finish_requests(request_ids, RequestStatus.FINISHED_STOPPED)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests() or self._pending is not None or bool(self._batch_queue)

    # ---- LoRA adapters (the model's side: lora/model_state.py) --------------------------------
    def add_lora(self, lora_request) -> float:
        """Load and check an adapter (ValueError: a bad one, nothing changed); the load's seconds."""
        self._loras_to_remove.discard(lora_request.lora_int_id)
        seconds = self.executor.add_lora(lora_request)
        self._lora_names[lora_request.lora_int_id] = lora_request.lora_name
        return seconds

    def remove_lora(self, lora_int_id: int) -> None:
        """Unload an adapter; requests running with it finish first (new ones are the caller's to refuse)."""
        self._loras_to_remove.add(lora_int_id)
        self._remove_unused_loras()

    def _remove_unused_loras(self) -> None:
        in_use = {r.lora_request.lora_int_id for r in self.scheduler.requests.values() if r.lora_request is not None}
        for lora_int_id in self._loras_to_remove - in_use:
            self.executor.remove_lora(lora_int_id)
            self._loras_to_remove.discard(lora_int_id)
            self._lora_names.pop(lora_int_id, None)

    def step(self) -> list[EngineCoreOutput]:
        if self._batch_queue is not None:
            return self._step_pipelined(self._batch_queue)
        if self._worker is None:
            if not self.scheduler.has_unfinished_requests():
                return []
            scheduler_output = self._schedule()
            return self._process(scheduler_output, self.executor.execute(scheduler_output))
        if self._pending is None:
            if not self.scheduler.has_unfinished_requests():
                return []
            self._pending = self._launch(self._schedule())
        ahead = None
        if self.scheduler.has_unfinished_requests() and self._can_schedule_ahead():
            ahead = self._launch(self._schedule())
        scheduler_output, future = self._pending
        self._pending = ahead
        return self._process(scheduler_output, future.result())

    def step_in_lockstep(self) -> list[EngineCoreOutput]:
        """A step of a replica whose experts are shared with the other data-parallel replicas
        (engine/core_proc.py runs every replica's step together): exactly one pass through the MoE
        layers, a dummy one (no tokens) when nothing here runs the model, so the experts' exchanges
        match across replicas. Such replicas have one rank and schedule synchronously."""
        outputs: list[EngineCoreOutput] = []
        ran_model = False
        if self.scheduler.has_unfinished_requests():
            scheduler_output = self._schedule()
            outputs = self._process(scheduler_output, self.executor.execute(scheduler_output))
            ran_model = not scheduler_output.is_empty
        if not ran_model:
            self.executor.execute_dummy_batch()
        return outputs

    def _step_pipelined(self, queue: deque) -> list[EngineCoreOutput]:
        """Keep up to one micro-batch per pipeline stage in flight: launch (the first stage runs in
        this process, then hands on) until the stages are full or nothing more can run, then take
        the oldest batch's output. The scheduler leaves requests with a token in flight out, so the
        batches in flight hold disjoint sampling requests; the bubble is (stages - 1) / batches."""
        launch = self.executor.execute_async  # the distributed executors: run the first stage, return a waiter
        while len(queue) < self._pipeline_depth and self.scheduler.has_unfinished_requests() \
                and (not queue or self._can_schedule_ahead()):
            scheduler_output = self._schedule()
            queue.append((scheduler_output, launch(scheduler_output)))
            if scheduler_output.is_empty:
                break
        if not queue:
            return []
        scheduler_output, result = queue.popleft()
        return self._process(scheduler_output, result())

    def _schedule(self) -> SchedulerOutput:
        scheduler_output = self.scheduler.schedule()
        if scheduler_output.is_empty and self.scheduler.has_compiling_requests():
            self.structured_output.wait_for_compilation(0.05)  # instead of spinning on empty steps
        if scheduler_output.is_empty and self.kv_connector is not None:
            self.kv_connector.scheduler.wait(0.05)  # KV in transit
        if scheduler_output.is_empty and self.scheduler.num_lora_loading:
            time.sleep(0.005)  # adapters loading off the loop, and nothing else to run meanwhile
        return scheduler_output

    def _launch(self, scheduler_output: SchedulerOutput) -> tuple[SchedulerOutput, Future[ModelRunnerOutput]]:
        assert self._worker is not None
        return scheduler_output, self._worker.submit(self.executor.execute, scheduler_output)

    def _can_schedule_ahead(self) -> bool:
        return self.scheduler.can_schedule_ahead() and not self.beam_search.has_groups()

    def _process(self, scheduler_output: SchedulerOutput, runner_output: ModelRunnerOutput) -> list[EngineCoreOutput]:
        self.num_steps += 1
        self.beam_search.take_results(runner_output)
        outputs = self.scheduler.update_from_output(scheduler_output, runner_output)
        self._publish_kv_events()
        if self._loras_to_remove:
            self._remove_unused_loras()
        if self.config.lora_config is not None:
            self._log_loras()
        if self.scheduler.spec_policy is not None:
            self._log_spec_decoding()
        if self.scheduler.expert_load is not None:
            self._log_expert_load()
        return outputs + self.beam_search.advance(stalled=scheduler_output.is_empty)

    def _log_loras(self) -> None:
        """Every LORA_LOG_INTERVAL_S: the resident adapters and the requests on each."""
        now = time.monotonic()
        if now - self._lora_logged < LORA_LOG_INTERVAL_S:
            return
        self._lora_logged = now
        stats = self._lora_stats()
        logger.info("LoRA adapters: resident %s; running %s; waiting %s", ", ".join(stats["resident"]) or "none",
                    stats["running"] or "none", stats["waiting"] or "none")

    def _log_spec_decoding(self) -> None:
        """Every SPEC_LOG_INTERVAL_S: the acceptance figures of the interval."""
        now = time.monotonic()
        last_time, last = self._spec_logged
        if now - last_time < SPEC_LOG_INTERVAL_S:
            return
        counters = self.scheduler.spec_stats.as_dict()
        figures = summarize(difference(counters, last))
        self._spec_logged = (now, counters)
        if figures is not None:
            logger.info("speculative decoding: mean accepted length %.2f, acceptance rate %.3f, %d drafts, "
                        "%d draft tokens, %d accepted; per position %s", figures["mean_accepted_length"],
                        figures["acceptance_rate"], figures["num_drafts"], figures["num_draft_tokens"],
                        figures["num_accepted_tokens"],
                        ", ".join(f"{r:.2f}" for r in figures["acceptance_rate_per_pos"]))

    def _log_expert_load(self) -> None:
        """Every EXPERT_LOAD_LOG_INTERVAL_S: how evenly the interval's tokens spread over the experts."""
        now = time.monotonic()
        last_time, last = self._expert_load_logged
        if now - last_time < EXPERT_LOAD_LOG_INTERVAL_S:
            return
        counters = self.scheduler.expert_load.as_dict()  # type: ignore[union-attr]
        figures = summarize_expert_load(counters, last)
        self._expert_load_logged = (now, counters)
        if figures is not None:
            logger.info("expert load: imbalance (max/mean) %.2f in layer %d (expert %d hottest), %.2f averaged over "
                        "layers; %d assignments, %d skipped by the capacity cap", figures["max_imbalance"],
                        figures["worst_layer"], figures["hottest_expert"], figures["mean_imbalance"],
                        figures["assignments"], figures["dropped"])

    def _publish_kv_events(self) -> None:
        if self._kv_event_recorder is not None:
            self.kv_events.publish(self._kv_event_recorder.take())  # type: ignore[union-attr]

    def get_stats(self) -> SchedulerStats:
        stats = self.scheduler.get_stats()
        if self.config.lora_config is not None:
            stats.lora = self._lora_stats()
        if self.memory is not None:
            stats.memory = dict(self.memory)
        return stats

    def _lora_stats(self) -> dict:
        return lora_stats(self.scheduler.running, self.scheduler.waiting, self.config.lora_config.max_loras,
                          self._lora_names, self.executor.lora_stats())

    def reset_prefix_cache(self) -> bool:
        reset = self.scheduler.kv_cache_manager.reset_prefix_cache()
        self._publish_kv_events()
        return reset

    def check_integrity(self) -> None:
        self.scheduler.kv_cache_manager.check_integrity()

    # ---- sleep mode and weight updates (worker/sleep_mode.py) -------------------------------------
    def sleep(self, level: int = 1) -> None:
        """Free the KV pool (level 1) and the weights (level 2); the prefix cache is forgotten."""
        self._check_quiet("sleep")
        if self.sleep_level:
            raise ValueError(f"the engine is already asleep (level {self.sleep_level})")
        self.executor.collective_rpc("sleep", (level,))
        self.reset_prefix_cache()
        self.sleep_level = level

    def wake_up(self) -> None:
        if not self.sleep_level:
            raise ValueError("the engine is awake")
        self.executor.collective_rpc("wake_up")
        self.sleep_level = 0

    def update_weights(self, weights=None, model_dir: str | None = None) -> int:
        """New weights from (name, tensor) pairs or a checkpoint directory; the prefix cache is
        reset, so no KV computed with the old weights serves a request. Returns the weight version."""
        self._check_quiet("updating weights")
        if (weights is None) == (model_dir is None):
            raise ValueError("give the new weights as (name, tensor) pairs or as a checkpoint directory")
        if model_dir is not None:
            version = self.executor.collective_rpc("update_weights_from_disk", (model_dir,))[0]
        else:
            version = self.executor.collective_rpc("update_weights", (weights,))[0]
        self.reset_prefix_cache()
        return version

    def _check_quiet(self, what: str) -> None:
        if not self.config.model_config.enable_sleep_mode:
            raise ValueError(f"{what} needs enable_sleep_mode=True (--enable-sleep-mode) when the engine starts")
        if self.has_unfinished_requests():
            raise ValueError(f"{what}: requests are in flight; let them finish or abort them first")

    def shutdown(self) -> None:
        if self._worker is not None:
            self._worker.shutdown(wait=True)
        self.structured_output.shutdown()
        self.executor.shutdown()
        if self.kv_connector is not None:
            self.kv_connector.shutdown()
        if self.kv_events is not None:
            self.kv_events.close()


def _no_tokenizer():
    raise ValueError("structured output needs the model's tokenizer, and this engine was built without one")
