"""EngineCore: the loop that owns the scheduler and drives the executor.

    step():  scheduler.schedule() -> executor.execute() -> scheduler.update_from_output()

Beam search plugs in around the step (engine/beam_search.py): it takes its beams' rows out of the
runner output before the scheduler sees them, then forks and drops beams.

The same class runs in-process (offline LLM) or inside the engine-core process (server).
"""

from __future__ import annotations

import logging
from typing import Protocol

from kvtide.config import EngineConfig
from kvtide.engine.beam_search import BeamSearch
from kvtide.engine.messages import EngineCoreOutput, SchedulerStats
from kvtide.engine.request import EngineCoreRequest, Request, RequestStatus
from kvtide.scheduler.output import ModelRunnerOutput, SchedulerOutput
from kvtide.scheduler.scheduler import Scheduler

logger = logging.getLogger(__name__)


class Executor(Protocol):
    def execute(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput: ...
    def shutdown(self) -> None: ...


class EngineCore:
    def __init__(self, config: EngineConfig, executor: Executor) -> None:
        self.config = config
        self.executor = executor
        self.scheduler = Scheduler(config.scheduler_config, config.cache_config,
                                   config.model_config.max_model_len)
        self.beam_search = BeamSearch(self.scheduler)
        self.num_steps = 0

    def add_request(self, core_request: EngineCoreRequest) -> None:
        """Admit a request; ValueError (nothing changed) if it can never run."""
        if not self.beam_search.add_request(core_request):
            self.scheduler.add_request(Request(core_request))

    def check_request(self, core_request: EngineCoreRequest) -> None:
        self.scheduler.check_request(Request(core_request))

    def abort_requests(self, request_ids: list[str]) -> None:
        request_ids = self.beam_search.abort(request_ids)
        self.scheduler.finish_requests(request_ids, RequestStatus.FINISHED_ABORTED)

    def stop_requests(self, request_ids: list[str]) -> None:
        """End requests that the output side found finished (a stop string)."""
        self.scheduler.finish_requests(request_ids, RequestStatus.FINISHED_STOPPED)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    def step(self) -> list[EngineCoreOutput]:
        if not self.scheduler.has_unfinished_requests():
            return []
        scheduler_output = self.scheduler.schedule()
        runner_output = self.executor.execute(scheduler_output)
        self.num_steps += 1
        self.beam_search.take_results(runner_output)
        outputs = self.scheduler.update_from_output(scheduler_output, runner_output)
        return outputs + self.beam_search.advance(stalled=scheduler_output.is_empty)

    def get_stats(self) -> SchedulerStats:
        return self.scheduler.get_stats()

    def reset_prefix_cache(self) -> bool:
        return self.scheduler.kv_cache_manager.reset_prefix_cache()

    def check_integrity(self) -> None:
        self.scheduler.kv_cache_manager.check_integrity()

    def shutdown(self) -> None:
        self.executor.shutdown()
