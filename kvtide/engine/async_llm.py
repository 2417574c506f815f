"""AsyncLLM: the engine as the server sees it, with the engine core in its own process.

    generate(prompt, params, request_id) ─▶ InputProcessor (tokenize, validate, split n)
                                            ─▶ EngineCoreClient.add_requests ─▶ engine-core process
    output handler task ◀─ EngineCoreClient.get_output ◀───────────────────────┘
        OutputProcessor (detokenize, stop strings, logprobs; DELTA)
        ─▶ per-request asyncio.Queue ─▶ the generate() iterator of that request

With --data-parallel-size N the client is a DPEngineCoreClient (dp_client.py): N engine-core
processes behind the same interface, each request routed to one of them by load and prefix affinity.

Errors, kept apart as DESIGN.md asks: ValueError (bad input, before anything is queued),
EngineQueueFullError (the waiting queue is full), EngineGenerateError (this request failed in the
engine), EngineDeadError (the engine-core process is gone; every request fails).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from kvtide.engine.core_client import (
    AddErrorMessage,
    EngineCoreClient,
    EngineCoreInfo,
    EngineDeadError,
    EngineGenerateError,
    EngineQueueFullError,
    OutputsMessage,
    SpawnedEngineCore,
)
from kvtide.engine.input_processor import InputProcessor, ProcessedPrompt, PromptType
from kvtide.engine.messages import EngineCoreOutput, SchedulerStats
from kvtide.engine.output_processor import OutputProcessor, RequestOutputKind
from kvtide.lora.request import LoRARequest
from kvtide.outputs import RequestOutput
from kvtide.pooling.outputs import PoolingRequestOutput
from kvtide.pooling.params import PoolingParams
from kvtide.sampling_params import SamplingParams

if TYPE_CHECKING:
    from kvtide.engine.dp_client import DPEngineCoreClient

__all__ = ["AsyncLLM", "EngineDeadError", "EngineGenerateError", "EngineQueueFullError",
           "FinishedRequestStats", "IterationStats", "StatLogger"]

logger = logging.getLogger(__name__)


@dataclass
class IterationStats:
    """Timings observed while routing one batch of engine outputs."""

    time_to_first_tokens: list[float] = field(default_factory=list)
    inter_token_latencies: list[float] = field(default_factory=list)
    queue_times: list[float] = field(default_factory=list)
    num_prompt_tokens: int = 0
    """Prompt tokens of requests that got their first token in this batch."""
    num_generation_tokens: int = 0
    num_pooling_requests: int = 0
    """Pooling requests (embeddings, classification, scores) that finished in this batch."""
    num_pooling_prompt_tokens: int = 0
    """Their prompt tokens: counted here, apart from generation's prompt tokens."""


@dataclass
class FinishedRequestStats:
    request_id: str
    finish_reason: str
    """'stop', 'length', 'abort' or 'error' (the first sample's, for n > 1)."""
    num_prompt_tokens: int
    num_generation_tokens: int
    e2e_latency: float
    time_to_first_token: float | None
    time_per_output_token: float | None


class StatLogger(Protocol):
    def record_iteration(self, stats: IterationStats) -> None: ...
    def record_finished(self, stats: FinishedRequestStats) -> None: ...


@dataclass
class _RequestState:
    request_id: str
    child_ids: list[str]
    num_prompt_tokens: int
    arrival_time: float
    queue: asyncio.Queue = field(default_factory=asyncio.Queue)
    first_token_time: float | None = None
    last_token_time: float | None = None
    num_generation_tokens: int = 0
    finish_reasons: dict[int, str] = field(default_factory=dict)
    queue_time_recorded: bool = False


class AsyncLLM:
    def __init__(self, client: EngineCoreClient | DPEngineCoreClient, tokenizer: Any,
                 stat_logger: StatLogger | None = None) -> None:
        assert client.info is not None
        self.client = client
        self.info: EngineCoreInfo = client.info
        self.tokenizer = tokenizer
        self.max_model_len = self.info.max_model_len
        self.input_processor = InputProcessor(tokenizer, self.info.vocab_size, self.info.max_model_len,
                                              self.info.eos_token_ids)
        self.input_processor.prompt_fills_context = self.info.pooler is not None
        self.output_processor = OutputProcessor(tokenizer)
        self.stat_logger = stat_logger
        self._requests: dict[str, _RequestState] = {}
        self._child_to_parent: dict[str, str] = {}
        client.add_dead_listener(self._on_engine_dead)
        self._output_task = asyncio.get_running_loop().create_task(self._run_output_handler())

    @classmethod
    async def from_engine_args(cls, engine_args: Any, stat_logger: StatLogger | None = None,
                               startup_timeout_s: float = 600.0,
                               engine_timeout_s: float | None = None,
                               spawned: SpawnedEngineCore | None = None) -> AsyncLLM:
        """Start the engine core (or, with `spawned`, wait for the one already started) and load
        the tokenizer meanwhile."""
        from kvtide.tokenizer import load_tokenizer

        def tokenizer_from_args():
            path = engine_args.tokenizer or engine_args.resolve_model_dir()
            return load_tokenizer(path, engine_args.trust_remote_code, engine_args.revision)

        # The tokenizer loads here while the engine core loads the model there.
        tokenizer_task = asyncio.ensure_future(asyncio.to_thread(tokenizer_from_args))
        try:
            client: EngineCoreClient | DPEngineCoreClient
            if getattr(engine_args, "data_parallel_size", 1) > 1:
                from kvtide.engine.dp_client import DPEngineCoreClient

                client = await DPEngineCoreClient.start(engine_args, startup_timeout_s, engine_timeout_s)
            else:
                client = await EngineCoreClient.start(engine_args, startup_timeout_s, engine_timeout_s,
                                                      spawned=spawned)
        except BaseException:
            await asyncio.gather(tokenizer_task, return_exceptions=True)
            raise
        try:
            engine = cls(client, await tokenizer_task, stat_logger)
            engine.input_processor.configure(engine_args, engine.info.model_dir)
            return engine
        except BaseException:
            client.shutdown()
            raise

    def shutdown(self) -> None:
        self._output_task.cancel()
        self.client.shutdown()

    # ---- state -----------------------------------------------------------------------------
    @property
    def is_dead(self) -> bool:
        return self.client.is_dead

    @property
    def num_unfinished_requests(self) -> int:
        return len(self._requests)

    @property
    def engine_core_pid(self) -> int:
        return self.info.pid

    @property
    def engine_core_pids(self) -> list[int]:
        """Every engine-core process (one per data-parallel replica)."""
        return self.client.pids

    @property
    def num_engines(self) -> int:
        return self.client.num_engines

    def process_prompt(self, prompt: PromptType, add_special_tokens: bool = True,
                       truncate_prompt_tokens: int | None = None) -> ProcessedPrompt:
        """Tokenize and validate a prompt (ValueError naming what is wrong)."""
        return self.input_processor.process_prompt(prompt, add_special_tokens, truncate_prompt_tokens)

    # ---- requests --------------------------------------------------------------------------
    async def generate(self, prompt: PromptType, params: SamplingParams, request_id: str,
                       priority: int = 0, add_special_tokens: bool = True,
                       output_kind: RequestOutputKind = RequestOutputKind.DELTA,
                       lora_request: LoRARequest | None = None, pooling_params: PoolingParams | None = None
                       ) -> AsyncIterator[RequestOutput | PoolingRequestOutput]:
        """Stream RequestOutputs of one request until it finishes: DELTA (what each step added),
        or FINAL_ONLY (one, whole, at the end: the offline LLM's).

        Leaving the iteration early (cancellation, an error, aclose) aborts the request in the
        engine, every sample of it. With `pooling_params` (a pooling model) the one output is a
        PoolingRequestOutput."""
        state = self._add_request(prompt, params, request_id, priority, add_special_tokens, output_kind,
                                  lora_request, pooling_params)
        finished = False
        try:
            while True:
                item = state.queue.get_nowait() if not state.queue.empty() else await state.queue.get()
                if item is None:  # aborted through abort()
                    finished = True
                    return
                if isinstance(item, BaseException):
                    finished = True
                    raise item
                finished = item.finished
                yield item
                if finished:
                    return
        finally:
            if not finished:
                self._abort(request_id, "abort")

    def _add_request(self, prompt: PromptType, params: SamplingParams, request_id: str, priority: int,
                     add_special_tokens: bool, output_kind: RequestOutputKind,
                     lora_request: LoRARequest | None = None,
                     pooling_params: PoolingParams | None = None) -> _RequestState:
        if self.client.dead_error is not None:
            raise self.client.dead_error
        if not isinstance(params, SamplingParams):
            raise ValueError(f"sampling_params must be SamplingParams, got {type(params).__name__}")
        if request_id in self._requests:
            raise ValueError(f"request_id {request_id!r} is already in use")
        processed = self.input_processor.process_prompt(prompt, add_special_tokens, params.truncate_prompt_tokens)
        arrival = time.time()
        core_requests = self.input_processor.make_requests(request_id, processed, params, priority, arrival,
                                                           lora_request=lora_request)
        for core_request in core_requests:
            core_request.pooling_params = pooling_params
        child_ids = [r.request_id for r in core_requests]
        state = _RequestState(request_id, child_ids, len(processed.prompt_token_ids), arrival)
        self.output_processor.add_request(request_id, processed.prompt, processed.prompt_token_ids, params,
                                          child_ids, output_kind, arrival)
        self._requests[request_id] = state
        for child_id in child_ids:
            self._child_to_parent[child_id] = request_id
        try:
            self.client.add_requests(core_requests)
        except BaseException:
            self._forget(request_id)
            raise
        return state

    async def abort(self, request_id: str) -> None:
        """Abort a request from outside; its generate() iterator ends without a final output."""
        state = self._requests.get(request_id)
        if state is not None:
            self._abort(request_id, "abort")
            state.queue.put_nowait(None)

    def _abort(self, request_id: str, reason: str) -> None:
        state = self._requests.get(request_id)
        if state is None:
            return
        child_ids = self.output_processor.abort_requests([request_id])
        self._finish(state, reason)
        if child_ids and not self.client.is_dead:
            self.client.abort_requests(child_ids)

    def _forget(self, request_id: str) -> None:
        state = self._requests.pop(request_id, None)
        self.output_processor.abort_requests([request_id])
        if state is not None:
            for child_id in state.child_ids:
                self._child_to_parent.pop(child_id, None)

    def _finish(self, state: _RequestState, reason: str) -> None:
        """Forget a request and record its stats (one log line per finished request)."""
        if self._requests.pop(state.request_id, None) is None:
            return
        for child_id in state.child_ids:
            self._child_to_parent.pop(child_id, None)
        now = time.time()
        ttft = state.first_token_time - state.arrival_time if state.first_token_time else None
        tpot = None
        if state.first_token_time and state.last_token_time and state.num_generation_tokens > len(state.child_ids):
            tpot = (state.last_token_time - state.first_token_time) / \
                (state.num_generation_tokens / len(state.child_ids) - 1)
        stats = FinishedRequestStats(state.request_id, reason, state.num_prompt_tokens,
                                     state.num_generation_tokens, now - state.arrival_time, ttft, tpot)
        logger.info("request %s finished (%s): prompt_tokens=%d output_tokens=%d ttft=%s e2e=%.3fs",
                    stats.request_id, reason, stats.num_prompt_tokens, stats.num_generation_tokens,
                    f"{ttft:.3f}s" if ttft is not None else "-", stats.e2e_latency)
        if self.stat_logger is not None:
            self.stat_logger.record_finished(stats)

    # ---- outputs ---------------------------------------------------------------------------
    async def _run_output_handler(self) -> None:
        try:
            while True:
                message = await self.client.get_output()
                if isinstance(message, OutputsMessage):
                    self._process_outputs(message)
                elif isinstance(message, AddErrorMessage):
                    self._process_add_error(message)
        except EngineDeadError:
            pass  # the dead listener has failed every request
        except asyncio.CancelledError:
            raise
        except Exception as e:  # a bug here would hang every request: fail them all loudly
            logger.exception("output handler failed")
            self.client.mark_dead(f"output handler failed: {type(e).__name__}: {e}")

    def _process_add_error(self, message: AddErrorMessage) -> None:
        parents = {self._child_to_parent[c] for c in message.request_ids if c in self._child_to_parent}
        for parent_id in parents:
            state = self._requests[parent_id]
            error: Exception = EngineQueueFullError(message.message) if message.kind == "queue_full" \
                else ValueError(message.message)
            self._forget(parent_id)
            state.queue.put_nowait(error)

    def _process_outputs(self, message: OutputsMessage) -> None:
        now = time.time()
        iteration = IterationStats()
        self._record_queue_times(message.scheduled_at, iteration)
        outputs: list[EngineCoreOutput] = []
        for out in message.outputs:
            if out.error is not None:
                self._fail_request(out)
            else:
                outputs.append(out)
        request_outputs, to_stop = self.output_processor.process_outputs(outputs)
        if to_stop:
            self.client.stop_requests(to_stop)
        for request_output in request_outputs:
            state = self._requests.get(request_output.request_id)
            if state is None:
                continue
            self._record_tokens(state, request_output, now, iteration)
            state.queue.put_nowait(request_output)
            if request_output.finished:
                reason = state.finish_reasons.get(0) or next(iter(state.finish_reasons.values()), "stop")
                self._finish(state, reason)
        if self.stat_logger is not None:
            self.stat_logger.record_iteration(iteration)

    def _record_queue_times(self, scheduled_at: dict[str, float], iteration: IterationStats) -> None:
        for child_id, when in scheduled_at.items():
            parent_id = self._child_to_parent.get(child_id)
            state = self._requests.get(parent_id) if parent_id is not None else None
            if state is not None and not state.queue_time_recorded:
                state.queue_time_recorded = True
                iteration.queue_times.append(max(0.0, when - state.arrival_time))

    def _record_tokens(self, state: _RequestState, output: RequestOutput | PoolingRequestOutput, now: float,
                       iteration: IterationStats) -> None:
        if isinstance(output, PoolingRequestOutput):  # prefill only: no tokens, no first-token time
            state.finish_reasons[0] = "stop"
            iteration.num_pooling_requests += 1
            iteration.num_pooling_prompt_tokens += state.num_prompt_tokens
            return
        num_new = sum(len(c.token_ids) for c in output.outputs)
        for completion in output.outputs:
            if completion.finish_reason is not None:
                state.finish_reasons[completion.index] = completion.finish_reason
        if num_new == 0:
            return
        if state.first_token_time is None:
            state.first_token_time = now
            iteration.time_to_first_tokens.append(now - state.arrival_time)
            iteration.num_prompt_tokens += state.num_prompt_tokens
        elif state.last_token_time is not None:
            iteration.inter_token_latencies.append(now - state.last_token_time)
        state.last_token_time = now
        state.num_generation_tokens += num_new
        iteration.num_generation_tokens += num_new

    def _fail_request(self, out: EngineCoreOutput) -> None:
        parent_id = self._child_to_parent.get(out.request_id)
        state = self._requests.get(parent_id) if parent_id is not None else None
        if state is None:
            return
        logger.error("request %s failed in the engine: %s", parent_id, out.error)
        self._abort(state.request_id, "error")
        state.queue.put_nowait(EngineGenerateError(str(out.error), out.error_status))

    def _on_engine_dead(self, error: EngineDeadError) -> None:
        for state in list(self._requests.values()):
            self.output_processor.abort_requests([state.request_id])
            self._finish(state, "error")
            state.queue.put_nowait(error)

    def fail_all_requests(self, error: Exception) -> int:
        """End every request in flight with `error` (raised from its generate() iterator) and abort
        it in the engine; e.g. when a drain's time is up. Returns how many there were."""
        states = list(self._requests.values())
        for state in states:
            self._abort(state.request_id, "error")
            state.queue.put_nowait(error)
        return len(states)

    # ---- utilities -------------------------------------------------------------------------
    async def get_stats(self, timeout_s: float | None = 5.0) -> SchedulerStats:
        from kvtide.engine.serialization import stats_from_wire

        return stats_from_wire(await self.client.call_utility("get_stats", timeout_s=timeout_s))

    async def get_engine_stats(self, timeout_s: float | None = 5.0) -> list[SchedulerStats]:
        """Each engine core's SchedulerStats (one per data-parallel replica), in rank order."""
        from kvtide.engine.serialization import stats_from_wire

        return [stats_from_wire(w) for w in await self.client.call_utility_each("get_stats", timeout_s=timeout_s)]

    def engine_summaries(self) -> list[dict[str, Any]]:
        """Per data-parallel replica: pid and the requests the balancer sent it; [] with one engine."""
        summaries = getattr(self.client, "engine_summaries", None)
        return summaries() if summaries is not None else []

    async def add_lora(self, lora_request: LoRARequest) -> float:
        """Load and check a LoRA adapter in the engine core; the load's seconds. EngineGenerateError
        (its message starting "ValueError:") for a bad adapter, with nothing changed."""
        return float(await self.client.call_utility("add_lora", dataclasses.asdict(lora_request), timeout_s=120.0))

    async def remove_lora(self, lora_int_id: int) -> None:
        """Unload an adapter; requests still running with it finish first."""
        await self.client.call_utility("remove_lora", lora_int_id, timeout_s=30.0)

    async def reset_prefix_cache(self) -> bool:
        return bool(await self.client.call_utility("reset_prefix_cache", timeout_s=30.0))

    async def check_integrity(self) -> None:
        await self.client.call_utility("check_integrity", timeout_s=30.0)

    # ---- sleep mode and weight updates (worker/sleep_mode.py): ValueError when refused ---------
    async def sleep(self, level: int = 1) -> int:
        return int(await self._utility_or_value_error("sleep", level))

    async def wake_up(self) -> int:
        return int(await self._utility_or_value_error("wake_up"))

    async def sleep_level(self) -> int:
        return int(await self.client.call_utility("sleep_level", timeout_s=30.0))

    async def update_weights_from_disk(self, model_path: str) -> int:
        return int(await self._utility_or_value_error("update_weights_from_disk", model_path))

    async def _utility_or_value_error(self, method: str, *args) -> object:
        """Weights load in seconds to minutes: no timeout; the engine's refusal comes back as the
        ValueError it raised."""
        try:
            return await self.client.call_utility(method, *args, timeout_s=None)
        except RuntimeError as e:
            message = str(e)
            if "ValueError: " in message:
                raise ValueError(message.split("ValueError: ", 1)[1]) from None
            raise

    async def check_health(self, timeout_s: float = 5.0) -> None:
        """Return if the engine core answers within timeout_s; raise EngineDeadError otherwise."""
        try:
            await self.client.call_utility("ping", timeout_s=timeout_s)
        except asyncio.TimeoutError as e:
            raise EngineDeadError(f"engine core did not answer within {timeout_s} s") from e
