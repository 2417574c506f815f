"""Executors run the model runner(s) for the engine core. Uniproc: the runner lives in the engine
core's own process (world size 1)."""

from __future__ import annotations

import torch

from kvtide.config import EngineConfig
from kvtide.scheduler.output import ModelRunnerOutput, SchedulerOutput
from kvtide.worker.memory_profile import MemoryMeter, profile_peak_activation_bytes
from kvtide.worker.model_runner import ModelRunner


class UniprocExecutor:
    def __init__(self, config: EngineConfig, model_dir: str) -> None:
        self.runner = ModelRunner(config, model_dir)
        self._num_threads = torch.get_num_threads()

    def kv_bytes_per_block(self) -> int:
        return self.runner.kv_bytes_per_block()

    def profile_peak_activation_bytes(self, memory_stats: MemoryMeter | None = None) -> int:
        return profile_peak_activation_bytes(self.runner, self.runner.config, memory_stats)

    def initialize_kv_cache(self, num_blocks: int) -> None:
        self.runner.initialize_kv_cache(num_blocks)

    def init_worker_thread(self) -> None:
        """Run once on a thread that will call execute (async scheduling): a new thread starts with
        torch's default intra-op thread count, not the one this process set."""
        torch.set_num_threads(self._num_threads)

    def execute(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        return self.runner.execute(scheduler_output)

    def execute_dummy_batch(self) -> None:
        self.runner.execute_dummy_batch()

    def shutdown(self) -> None:
        pass
