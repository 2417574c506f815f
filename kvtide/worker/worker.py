"""One rank of a replica: its share of the model (a ModelRunner built inside the process group) and
the handling of the executor's messages. The multiprocess executor runs it in a spawned process
(`run_worker_process`), the Ray executor inside an actor; both speak the same messages:

    executor -> worker                      worker -> executor
                                            ["prepared", rank] (its config built; joining the group next)
    ["init_kv", num_blocks]                 ["ready", rank, kv_bytes_per_block, weight_bytes]
    ["profile"]                             ["kv_ready", rank] / ["profiled", rank, peak_bytes]
    ["execute", scheduler_output]           ["output", rank, ModelRunnerOutput bytes] (output rank only)
    ["comm_stats"]                          ["comm_stats", rank, {kind: {calls, bytes, seconds}}]
    ["shutdown"]                            ["error", rank, traceback]
"""

from __future__ import annotations

import logging
import os
import socket
import traceback
from typing import Any

import torch

from kvtide.config import EngineConfig
from kvtide.distributed import (
    COMM_STATS,
    ParallelLayout,
    destroy_distributed,
    init_distributed,
    refuse_live_process_group,
)
from kvtide.engine import serialization
from kvtide.worker import wire

logger = logging.getLogger(__name__)


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def layout_of(config: EngineConfig, rank: int) -> ParallelLayout:
    pc = config.parallel_config
    return ParallelLayout(tensor_parallel_size=pc.tensor_parallel_size, pipeline_parallel_size=pc.pipeline_parallel_size,
                          rank=rank, enable_expert_parallel=pc.enable_expert_parallel)


def output_rank(config: EngineConfig) -> int:
    """The rank whose ModelRunnerOutput the engine gets: the last stage's first TP rank."""
    pc = config.parallel_config
    return (pc.pipeline_parallel_size - 1) * pc.tensor_parallel_size


def threads_per_rank(config: EngineConfig) -> int:
    from kvtide.distributed.config_checks import usable_cpus

    pc = config.parallel_config
    return pc.cpu_threads_per_rank or max(1, usable_cpus() // pc.world_size)


def init_rank(config: EngineConfig, rank: int, init_method: str) -> None:
    """Cores or device, then the process group, of one rank. On CPU each rank runs its share of
    the threads, pinned to its own cores of this process's CPU set when there are enough of them
    (rank r: cores [r*t, (r+1)*t)), so ranks do not contend for the same cores."""
    refuse_live_process_group()
    if config.device_config.device == "cpu":
        threads = threads_per_rank(config)
        cpus = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
        if len(cpus) >= config.parallel_config.world_size * threads:
            os.sched_setaffinity(0, cpus[rank * threads:(rank + 1) * threads])
        torch.set_num_threads(threads)
    else:
        torch.cuda.set_device(rank % max(torch.cuda.device_count(), 1))
    backend = "nccl" if config.device_config.device == "cuda" else "gloo"
    init_distributed(layout_of(config, rank), init_method, backend)


def engine_config_from_args(engine_args: dict[str, Any], model_dir: str) -> EngineConfig:
    """The replica's EngineConfig, rebuilt in a worker from the engine's arguments (plain JSON
    crosses the process boundary, never a pickle)."""
    from kvtide.engine_args import EngineArgs

    return EngineArgs(**engine_args).create_engine_config(model_dir)


class Worker:
    """A non-driver rank: builds its runner, then answers messages (`handle`)."""

    def __init__(self, engine_args: dict[str, Any], model_dir: str, rank: int, init_method: str) -> None:
        from kvtide.worker.model_runner import ModelRunner

        self.config = config = engine_config_from_args(engine_args, model_dir)
        self.rank = rank
        init_rank(config, rank, init_method)
        self.runner = ModelRunner(config, model_dir)
        self.is_output_rank = rank == output_rank(config)

    def ready_message(self) -> list[Any]:
        return ["ready", self.rank, self.runner.kv_bytes_per_block(), self.runner.weight_bytes]

    def handle(self, message: list[Any]) -> list[Any] | None:
        """One message; the reply to send back, if any."""
        kind = message[0]
        if kind == "execute":
            output = self.runner.execute(wire.scheduler_output_from_wire(message[1]))
            return ["output", self.rank, wire.runner_output_to_wire(output)] if self.is_output_rank else None
        if kind == "init_kv":
            self.runner.initialize_kv_cache(message[1])
            return ["kv_ready", self.rank]
        if kind == "profile":
            from kvtide.worker.memory_profile import CudaMemoryMeter, profile_peak_activation_bytes

            return ["profiled", self.rank, profile_peak_activation_bytes(self.runner, self.config, CudaMemoryMeter())]
        if kind == "comm_stats":
            return ["comm_stats", self.rank, COMM_STATS.snapshot()]
        raise ValueError(f"unknown worker message {kind!r}")

    def close(self) -> None:
        destroy_distributed()


def run_worker_process(engine_args: dict[str, Any], model_dir: str, rank: int, init_method: str,
                       input_address: str, output_address: str, parent_pid: int) -> None:
    """The multiprocess executor's worker: messages in on a PULL socket, replies out on a PUSH one.
    It exits when told, when its parent is gone, or after reporting an error."""
    import zmq

    from kvtide.child_process import die_with_parent

    die_with_parent()  # never outlive the engine, even while blocked in a collective
    logging.basicConfig(level=logging.WARNING, format=f"[rank {rank}] %(levelname)s %(name)s: %(message)s")
    ctx = zmq.Context()
    inbox = ctx.socket(zmq.PULL)
    inbox.connect(input_address)
    outbox = ctx.socket(zmq.PUSH)
    outbox.connect(output_address)
    worker = None
    try:
        engine_config_from_args(engine_args, model_dir)  # a bad config or checkpoint fails here, before
        outbox.send(serialization.encode(["prepared", rank]))     # rank 0 waits in the rendezvous for this rank
        worker = Worker(engine_args, model_dir, rank, init_method)
        outbox.send(serialization.encode(worker.ready_message()))
        while True:
            if not inbox.poll(1000):
                if os.getppid() != parent_pid:  # orphaned: the engine is gone
                    return
                continue
            message = serialization.decode(inbox.recv())
            if message[0] == "shutdown":
                return
            reply = worker.handle(message)
            if reply is not None:
                outbox.send(serialization.encode(reply))
    except BaseException:
        outbox.send(serialization.encode(["error", rank, traceback.format_exc()]))
        outbox.close(linger=2000)
        os._exit(1)
    finally:
        if worker is not None:
            worker.close()
        ctx.destroy(linger=1000)


def main() -> None:
    import argparse

    from kvtide.private_files import read_args_file

    parser = argparse.ArgumentParser(description="one worker rank of a kvtide replica (started by the engine)")
    parser.add_argument("--engine-args-file", required=True,
                        help="a 0600 JSON file of EngineArgs, read and deleted at start (secrets stay off argv)")
    parser.add_argument("--model-dir", required=True)
    parser.add_argument("--rank", type=int, required=True)
    parser.add_argument("--init-method", required=True)
    parser.add_argument("--input", required=True)
    parser.add_argument("--output", required=True)
    parser.add_argument("--parent-pid", type=int, required=True)
    ns = parser.parse_args()
    run_worker_process(read_args_file(ns.engine_args_file), ns.model_dir, ns.rank, ns.init_method, ns.input, ns.output,
                       ns.parent_pid)


if __name__ == "__main__":
    main()
