"""The multiprocess executor: a replica's ranks 1.. as worker processes on this node, spawned as
`python -m kvtide.worker.worker` (worker.py), the config rebuilt there from the EngineArgs JSON,
never a pickle. Messages go to each worker on its own ZMQ PUSH socket and every reply comes back on
one PULL socket, all in a directory only this user can enter. The step logic is the distributed
executor's (distributed_executor.py); this module only starts the processes and moves the bytes.

A worker that exits is noticed by polling its process (twice a second in the monitor thread, and
at every wait for a reply).
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
from typing import Any

import zmq

from kvtide.config import EngineConfig
from kvtide.engine import serialization
from kvtide.private_files import private_dir, remove_private_dir, write_args_file
from kvtide.worker.distributed_executor import STARTUP_TIMEOUT_S, DistributedExecutor, Gather, WorkerDiedError
from kvtide.worker.worker import free_port

__all__ = ["MultiprocExecutor", "ProcessRanks", "WorkerDiedError"]

_MONITOR_INTERVAL_S = 0.5


class ProcessRanks:
    """Ranks 1.. as child processes; replies arrive on one socket, in each worker's order."""

    device_index = None

    def __init__(self, config: EngineConfig, model_dir: str, engine_args: dict[str, Any]) -> None:
        self.world_size = config.parallel_config.world_size
        self.model_dir = model_dir
        self.engine_args = engine_args
        self.processes: list[subprocess.Popen] = []
        self._ctx = zmq.Context()
        self._inboxes: list[zmq.Socket] = []
        # Sockets and the workers' args files in a directory only this user can enter (the args may
        # hold secrets: they never go on a command line).
        self._private_dir = private_dir("kvtide-workers-")
        self._outbox = self._ctx.socket(zmq.PULL)
        self._outbox.bind(f"ipc://{self._base}-out")

    @property
    def _base(self) -> str:
        return os.path.join(self._private_dir, "w")

    def launch(self, gather: Gather) -> str:
        init_method = f"tcp://127.0.0.1:{free_port()}"
        for rank in range(1, self.world_size):
            inbox = self._ctx.socket(zmq.PUSH)
            inbox.bind(f"ipc://{self._base}-in{rank}")
            self._inboxes.append(inbox)
            self.processes.append(subprocess.Popen(
                [sys.executable, "-m", "kvtide.worker.worker", "--engine-args-file",
                 write_args_file(self.engine_args, self._private_dir), "--model-dir", self.model_dir,
                 "--rank", str(rank), "--init-method", init_method, "--input", f"ipc://{self._base}-in{rank}",
                 "--output", f"ipc://{self._base}-out", "--parent-pid", str(os.getpid())]))
        gather(None, "prepared", STARTUP_TIMEOUT_S)  # each worker reports it unasked, then joins
        return init_method

    def join(self, init_method: str) -> None:
        """The workers join the process group on their own once prepared (they got init_method at spawn)."""
        return None

    def send(self, data: bytes) -> None:
        for inbox in self._inboxes:
            inbox.send(data)

    def poll(self, sent: None, timeout_s: float) -> bytes | None:
        return self._outbox.recv() if self._outbox.poll(int(timeout_s * 1000)) else None

    def pending(self, sent: None) -> bool:
        return False

    def lost_rank(self) -> str | None:
        for rank, proc in enumerate(self.processes, start=1):
            if proc.poll() is not None:
                return f"worker rank {rank} exited (code {proc.returncode})"
        return None

    def wait_for_lost_rank(self, closing: threading.Event) -> str | None:
        while not closing.wait(_MONITOR_INTERVAL_S):
            reason = self.lost_rank()
            if reason is not None:
                return reason
        return None

    def close(self) -> None:
        for inbox in self._inboxes:
            try:
                inbox.send(serialization.encode(["shutdown"]), zmq.NOBLOCK)
            except zmq.ZMQError:
                pass
        for proc in self.processes:
            try:
                proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=5)
        self.processes = []
        self._ctx.destroy(linger=0)
        remove_private_dir(self._private_dir)


class MultiprocExecutor(DistributedExecutor):
    """A replica whose ranks 1.. are worker processes on this node."""

    def __init__(self, config: EngineConfig, model_dir: str, engine_args: dict[str, Any]) -> None:
        """`engine_args`: the EngineArgs `config` came from, as a dict (workers rebuild it)."""
        self.ranks = ProcessRanks(config, model_dir, engine_args)
        super().__init__(config, model_dir, self.ranks)

    @property
    def workers(self) -> list[subprocess.Popen]:
        """The worker processes, rank 1 first."""
        return self.ranks.processes
