"""DataParallelLLMEngine: the offline LLM's engine when data_parallel_size > 1 (vLLM's
`LLM(data_parallel_size=N)`).

The replicas are the server's: AsyncLLM over DPEngineCoreClient (N engine-core processes, each
pinned to its share of the cores, each request routed by load and prefix affinity, any replica's
death the engine's), behind the synchronous surface LLM uses of LLMEngine (add_request /
abort_request / has_unfinished_requests / step). Each request runs as one task consuming
AsyncLLM.generate with FINAL_ONLY outputs; step() waits until some finish.

The event loop is this object's own, run by a thread of its own, and every call waits for the
coroutine it hands over. So LLM works from any thread, also one already running a loop (async
code, a notebook); a replica's death is noticed between calls too; and an exception the engine
keeps (the dead engine's error) holds frames of the loop's thread only, never the caller's, which
would keep the LLM, and so its replicas, alive after the caller drops it.

The engine-core's own checks of a request (KV capacity, a full queue) answer asynchronously here,
so such a refusal surfaces from step(), after which LLM aborts the rest of the batch, as a
world-size-1 LLM takes back a batch whose late request is refused.
"""

from __future__ import annotations

import asyncio
import collections
import itertools
import threading
from collections.abc import Coroutine, Iterable
from typing import Any, TypeVar

from kvtide.engine.async_llm import AsyncLLM
from kvtide.engine.core_client import EngineDeadError
from kvtide.engine.input_processor import PromptType
from kvtide.engine.messages import SchedulerStats
from kvtide.engine.output_processor import RequestOutputKind
from kvtide.outputs import RequestOutput
from kvtide.sampling_params import SamplingParams

T = TypeVar("T")


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
        self._thread = threading.Thread(target=self._loop.run_forever, name="kvtide-dp-llm", daemon=True)
        self._thread.start()
        self._closed = False
        try:
            self.llm = self._run(AsyncLLM.from_engine_args(engine_args, startup_timeout_s=startup_timeout_s))
        except BaseException:
            self._closed = True
            self._stop_loop()
            raise
        self.tokenizer = self.llm.tokenizer
        self.input_processor = self.llm.input_processor
        self._ids = itertools.count()
        # Changed only by coroutines on the loop's thread, while the caller waits:
        self._tasks: dict[str, asyncio.Task] = {}
        self._ended: collections.deque[asyncio.Task] = collections.deque()
        """Request tasks as they end, aborted ones too (step skips those no longer in _tasks): a
        step costs O(1) a request, not a scan of the batch."""
        self._some_ended = asyncio.Event()

    def _run(self, coro: Coroutine[Any, Any, T]) -> T:
        if self._loop.is_closed() or not self._thread.is_alive():
            coro.close()
            raise RuntimeError("this LLM has been shut down")
        future = asyncio.run_coroutine_threadsafe(self._fresh_errors(coro), self._loop)
        try:
            return future.result()
        except BaseException:
            future.cancel()  # interrupted (Ctrl-C): the coroutine stops too
            raise

    @staticmethod
    async def _fresh_errors(coro: Coroutine[Any, Any, T]) -> T:
        """The dead engine's error is one object the clients keep: raised to the caller it would
        collect the caller's frames. A new one, per call, goes instead."""
        try:
            return await coro
        except EngineDeadError as e:
            raise EngineDeadError(f"a data-parallel replica died ({e}); shut this LLM down and start "
                                  f"a new one") from e

    @property
    def engine_core_pids(self) -> list[int]:
        return self.llm.engine_core_pids

    def next_request_id(self) -> str:
        return str(next(self._ids))

    def add_request(self, request_id: str, prompt: PromptType, params: SamplingParams, priority: int = 0,
                    lora_request=None, pooling_params=None) -> None:
        """Validate and send one request to its replica; ValueError before anything is queued. LoRA
        adapters and pooling requests run on one replica only (EngineArgs refuses the flags with
        data parallelism), so here they are refused too."""
        if lora_request is not None or pooling_params is not None:
            raise ValueError("LoRA adapters and pooling requests do not run under data parallelism yet")
        self._run(self._add(request_id, prompt, params, priority))

    async def _add(self, request_id: str, prompt: PromptType, params: SamplingParams, priority: int) -> None:
        if request_id in self._tasks:
            raise ValueError(f"request_id {request_id!r} is already in use")
        task = asyncio.get_running_loop().create_task(self._final_output(prompt, params, request_id, priority),
                                                      name=request_id)
        self._tasks[request_id] = task  # tracked at once: an interrupted add is still aborted
        task.add_done_callback(self._on_task_end)
        await asyncio.sleep(0)  # the task adds the request, up to its first wait
        if task.done():  # refused before anything was queued
            del self._tasks[request_id]
            task.result()

    def _on_task_end(self, task: asyncio.Task) -> None:
        self._ended.append(task)
        self._some_ended.set()

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
        request_ids = [r for r in request_ids if r in self._tasks]
        if request_ids:
            self._run(self._abort(request_ids))

    async def _abort(self, request_ids: list[str]) -> None:
        tasks = [self._tasks.pop(r) for r in request_ids if r in self._tasks]
        for task in tasks:
            task.cancel()  # leaving the generate() iteration aborts the request on its replica
        await asyncio.gather(*tasks, return_exceptions=True)

    def abort_unfinished(self) -> None:
        self.abort_request(list(self._tasks))

    def has_unfinished_requests(self) -> bool:
        return bool(self._tasks)

    def step(self) -> list[RequestOutput]:
        """Wait until at least one request finishes; the final outputs of every one that has. A
        request the engine refused raises its ValueError; a dead replica raises EngineDeadError."""
        return self._run(self._step())

    async def _step(self) -> list[RequestOutput]:
        done: list[asyncio.Task] = []
        while self._tasks and not done:
            while not self._ended:
                self._some_ended.clear()
                await self._some_ended.wait()
            done = [t for t in self._ended if self._tasks.get(t.get_name()) is t]
            self._ended.clear()
        for task in done:  # all forgotten first, so a failure leaves no finished task behind
            del self._tasks[task.get_name()]
        errors = [e for e in (task.exception() for task in done) if e is not None]
        if errors:
            raise errors[0]
        return [task.result() for task in done]

    def reset_prefix_cache(self) -> bool:
        return self._run(self.llm.reset_prefix_cache())

    def get_engine_stats(self) -> list[SchedulerStats]:
        """Each replica's scheduler stats, as its own process reports them, in rank order."""
        return self._run(self.llm.get_engine_stats())

    def shutdown(self) -> None:
        """Stop every replica process, then the loop and its thread. Idempotent; safe from a
        finalizer, whichever thread runs it."""
        if self._closed:
            return
        self._closed = True
        if threading.current_thread() is self._thread:  # collected on the loop's own thread: cannot wait on it
            self.llm.shutdown()
            self._loop.stop()
            return
        try:
            self._run(self._shutdown())
        finally:
            self._stop_loop()

    async def _shutdown(self) -> None:
        await self._abort(list(self._tasks))
        self.llm.shutdown()  # on the loop's thread: the clients' sockets belong to this loop

    def _stop_loop(self) -> None:
        """End what still runs on the loop (the clients' watchers; a start that was interrupted,
        which then stops its processes), then the loop and its thread."""
        try:
            asyncio.run_coroutine_threadsafe(self._cancel_the_rest(), self._loop).result()
        finally:
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join()
            self._loop.close()

    async def _cancel_the_rest(self) -> None:
        tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await self._loop.shutdown_asyncgens()
