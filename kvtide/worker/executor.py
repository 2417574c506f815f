"""Executors run the model runner(s) for the engine core. Uniproc: the runner lives in the engine
core's own process (world size 1). It offers what the distributed executor offers
(distributed_executor.py), so the engine core drives either the same way, and one thing of its own:
the lockstep of data-parallel replicas that share their experts (each has one rank)."""

from __future__ import annotations

from collections.abc import Callable

import torch

from kvtide.config import EngineConfig
from kvtide.distributed import COMM_STATS, get_replica_sync_group
from kvtide.scheduler.output import ModelRunnerOutput, SchedulerOutput
from kvtide.worker.memory_profile import MemoryMeter, profile_peak_activation_bytes
from kvtide.worker.model_runner import ModelRunner

ReplicaAgreement = Callable[[bool, bool], tuple[bool, bool]]
"""(this replica has work, this replica stops) -> (any replica has work, any replica stops)."""


class UniprocExecutor:
    def __init__(self, config: EngineConfig, model_dir: str) -> None:
        self.runner = ModelRunner(config, model_dir)
        self._num_threads = torch.get_num_threads()
        self.dead: str | None = None
        """Always None: no other rank can die under this one."""
        self.on_worker_death: Callable[[str], None] | None = None

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

    def execute_async(self, scheduler_output: SchedulerOutput) -> Callable[[], ModelRunnerOutput]:
        output = self.runner.execute(scheduler_output)
        return lambda: output

    def execute_dummy_batch(self) -> None:
        """A pass with no tokens: a replica in lockstep with nothing to run still enters the
        experts' exchanges."""
        self.runner.execute_dummy_batch()

    def add_lora(self, lora_request) -> float:
        """Load and check a LoRA adapter into host memory (ValueError: a bad one, nothing kept);
        returns the seconds the load took (0.0: it was loaded already)."""
        return self._lora().add_adapter(lora_request)

    def remove_lora(self, lora_int_id: int) -> bool:
        return self._lora().remove_adapter(lora_int_id)

    def lora_stats(self) -> dict:
        return self._lora().stats()

    def lora_prefetch(self, lora_request) -> bool:
        """Whether a waiting request's adapter is ready for a step; if not, it starts loading off
        the step loop (lora/model_state.py prefetch)."""
        return self._lora().prefetch(lora_request)

    def _lora(self):
        if self.runner.lora is None:
            raise ValueError("LoRA adapters need an engine started with enable_lora=True (--enable-lora)")
        return self.runner.lora

    def comm_stats(self) -> dict[int, dict[str, dict[str, float]]]:
        return {0: self.local_comm_stats()}

    def local_comm_stats(self) -> dict[str, dict[str, float]]:
        """This process's collectives: a replica sharing its experts counts their exchanges."""
        return COMM_STATS.snapshot()

    def replica_lockstep(self) -> ReplicaAgreement | None:
        """Replicas sharing their experts step together (engine/core_proc.py): every iteration they
        agree whether any has work and whether any stops, an all-reduce of two flags over their gloo
        group. None when this replica shares nothing."""
        group = get_replica_sync_group()
        if group is None:
            return None
        flags = torch.zeros(2, dtype=torch.int64)

        def agree(has_work: bool, stopping: bool) -> tuple[bool, bool]:
            flags[0], flags[1] = int(has_work), int(stopping)
            group.all_reduce(flags)
            return bool(flags[0]), bool(flags[1])
        return agree

    def collective_rpc(self, method: str, args: tuple = (), kwargs: dict | None = None) -> list:
        """`method` on every rank's runner (here the one), each rank's result in a list: the sleep
        mode and weight-update calls (worker/sleep_mode.py), else the runner's own method."""
        from kvtide.worker.sleep_mode import RUNNER_CALLS

        call = RUNNER_CALLS.get(method)
        if call is None:
            return [getattr(self.runner, method)(*args, **(kwargs or {}))]
        return [call(self.runner, *args, **(kwargs or {}))]

    def shutdown(self) -> None:
        if self.runner.lora is not None:
            self.runner.lora.shutdown()
