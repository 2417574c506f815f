"""DataParallelLLMEngine: the offline LLM's engine when data_parallel_size > 1 (vLLM's
`LLM(data_parallel_size=N)`).

The replicas are the server's: AsyncLLM over DPEngineCoreClient (N engine-core processes, each
pinned to its share of the cores, each request routed by load and prefix affinity, any replica's
death the engine's), driven from an event loop this object owns, behind the synchronous surface
LLM uses of LLMEngine (add_request / abort_request / has_unfinished_requests / step). Each request
runs as one task consuming AsyncLLM.generate with FINAL_ONLY outputs; step() runs the loop until
some finish. The engine-core's own checks of a request (KV capacity, grammar) answer asynchronously
here, so such a refusal surfaces from step() as the ValueError LLM.generate raises, after which LLM
aborts the rest of the batch.
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Iterable
from typing import Any

from kvtide.engine.async_llm import AsyncLLM
from kvtide.engine.core_client import EngineDeadError
from kvtide.engine.input_processor import PromptType
from kvtide.engine.output_processor import RequestOutputKind
from kvtide.outputs import RequestOutput
from kvtide.sampling_params import SamplingParams


class DataParallelLLMEngine:
    def __init__(self, engine_args: Any, startup_timeout_s: float = 600.0) -> None:
        local = engine_args.data_parallel_size_local
        if local is not None and local != engine_args.data_parallel_size:
            raise ValueError(f"data_parallel_size_local={local} < data_parallel_size="
                             f"{engine_args.data_parallel_size}: replicas on other nodes join a server "
                             f"(kvtide serve --headless); the offline LLM runs all of its replicas here")
        if engine_args.data_parallel_start_rank:
            raise ValueError("data_parallel_start_rank is for a headless serving node, not the offline LLM")
        self._loop = asyncio.new_event_loop()
        try:
            self.llm = self._loop.run_until_complete(
                AsyncLLM.from_engine_args(engine_args, startup_timeout_s=startup_timeout_s))
        except BaseException:
            self._loop.close()
            raise
        self.tokenizer = self.llm.tokenizer
        self.input_processor = self.llm.input_processor
        self._ids = itertools.count()
        self._tasks: dict[str, asyncio.Task] = {}
        self._closed = False

    @property
    def engine_core_pids(self) -> list[int]:
        return self.llm.engine_core_pids

    def next_request_id(self) -> str:
        return str(next(self._ids))

    def add_request(self, request_id: str, prompt: PromptType, params: SamplingParams, priority: int = 0) -> None:
        """Validate and send one request to its replica; ValueError before anything is queued."""
        if request_id in self._tasks:
            raise ValueError(f"request_id {request_id!r} is already in use")
        task = self._loop.create_task(self._final_output(prompt, params, request_id, priority), name=request_id)
        self._loop.run_until_complete(asyncio.sleep(0))  # the task adds the request, up to its first wait
        if task.done() and task.exception() is not None:
            raise task.exception()
        self._tasks[request_id] = task

    async def _final_output(self, prompt: PromptType, params: SamplingParams, request_id: str,
                            priority: int) -> RequestOutput:
        final = None
        async for output in self.llm.generate(prompt, params, request_id, priority,
                                              output_kind=RequestOutputKind.FINAL_ONLY):
            final = output
        if final is None:
            raise RuntimeError(f"request {request_id} was aborted")
        return final

    def abort_request(self, request_ids: Iterable[str]) -> None:
        tasks = [self._tasks.pop(r) for r in list(request_ids) if r in self._tasks]
        for task in tasks:
            task.cancel()  # leaving the generate() iteration aborts the request on its replica
        if tasks:
            self._loop.run_until_complete(asyncio.gather(*tasks, return_exceptions=True))

    def abort_unfinished(self) -> None:
        self.abort_request(list(self._tasks))

    def has_unfinished_requests(self) -> bool:
        return bool(self._tasks)

    def step(self) -> list[RequestOutput]:
        """Wait until at least one request finishes; their final outputs. A request the engine
        refused raises its ValueError; a dead replica raises EngineDeadError."""
        if not self._tasks:
            return []
        done, _ = self._loop.run_until_complete(
            asyncio.wait(list(self._tasks.values()), return_when=asyncio.FIRST_COMPLETED))
        outputs = []
        for task in done:
            self._tasks.pop(task.get_name(), None)
        for task in done:  # collected first, so a failure leaves no finished task behind
            error = task.exception()
            if isinstance(error, EngineDeadError):
                raise RuntimeError(f"a data-parallel replica died: {error}") from error
            if error is not None:
                raise error
            outputs.append(task.result())
        return outputs

    def reset_prefix_cache(self) -> bool:
        return self._loop.run_until_complete(self.llm.reset_prefix_cache())

    def shutdown(self) -> None:
        """Stop every replica process. Idempotent."""
        if self._closed:
            return
        self._closed = True
        try:
            self.abort_unfinished()
        finally:
            self.llm.shutdown()
            self._loop.run_until_complete(asyncio.sleep(0))  # let cancelled tasks finish
            self._loop.close()
