"""One replica of tensor_parallel_size x pipeline_parallel_size ranks, driven from the engine core's
process. Rank 0 runs here, beside structured output's matchers (it applies them under tensor
parallelism); ranks 1.. run elsewhere, reached through a `RankTransport` that only starts them and
moves worker.py's messages: spawned processes over ZMQ (multiproc_executor.py) or Ray actors
(ray_executor.py). The step logic is written once, here:

    execute        the step goes to ranks 1.. as msgpack (wire.py), rank 0 runs its part, every
                   rank the same collectives in the same order; the output rank's ModelRunnerOutput
                   comes back (rank 0's own under tensor parallelism, the last stage's under
                   pipeline parallelism, where the next micro-batch may start before it returns)
    stages         under pipeline parallelism the last stage's tokens are relayed to the earlier
                   stages, structured output's drafts and masks computed ahead, and the first
                   stage's expert load merged into the last stage's (pipeline_stages.py)
    worker death   a rank that exits or reports an error is noticed within a second (a monitor
                   thread, and every wait on the ranks; rank 0 blocked in a collective with it sees
                   its connection reset): the step raises WorkerDiedError, and `on_worker_death`
                   lets the engine-core process exit at once, even while idle
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable
from typing import Any, Protocol

import torch

from kvtide.config import EngineConfig
from kvtide.distributed import COMM_STATS, destroy_distributed
from kvtide.engine import serialization
from kvtide.scheduler.output import ModelRunnerOutput, SchedulerOutput
from kvtide.worker import wire
from kvtide.worker.pipeline_stages import GrammarAhead, SampledTokenRelay, merge_expert_load
from kvtide.worker.worker import init_rank, output_rank, threads_per_rank

logger = logging.getLogger(__name__)

STARTUP_TIMEOUT_S = 600.0
"""How long the workers may take to load their shards and answer."""
POLL_S = 0.2
"""How long one wait for a reply lasts before the ranks' health is checked again."""
LOST_RANK_GRACE_S = 5.0
"""After rank 0's collective failed: how long to wait for the rank that caused it to be named."""

Sent = Any
"""What a transport hands back for a message sent to ranks 1..: where their replies will come."""
Gather = Callable[[Sent, str, float | None], list[list[Any]]]


class WorkerDiedError(RuntimeError):
    """A rank of the replica exited or reported an error; the replica cannot go on."""


class RankTransport(Protocol):
    """How ranks 1.. of a replica are started and reached. Messages and replies are worker.py's,
    msgpack bytes; every reply names its rank (reply[1])."""

    device_index: int | None
    """Rank 0's CUDA device when the transport chose it (Ray: the GPU of bundle 0), else None."""

    def launch(self, gather: Gather) -> str:
        """Start ranks 1.. and see each rebuild its config (their "prepared" replies, collected with
        `gather`, so a bad node fails before rank 0 waits in the rendezvous); returns the
        init_method of the process group."""

    def join(self, init_method: str) -> Sent:
        """Let ranks 1.. join the process group and build their runners; their "ready" replies
        answer the returned Sent."""

    def send(self, data: bytes) -> Sent:
        """One message to every rank 1.., in order after the ones before it."""

    def poll(self, sent: Sent, timeout_s: float) -> bytes | None:
        """The next reply to `sent` (b"": a rank with nothing to say), or None if none came within
        timeout_s. Raises WorkerDiedError when a rank's reply was lost with the rank."""

    def pending(self, sent: Sent) -> bool:
        """Whether a rank still owes a reply to `sent` (False where only the reply count tells)."""

    def lost_rank(self) -> str | None:
        """Why a rank is gone, when a glance tells (its process exited); else None."""

    def wait_for_lost_rank(self, closing: threading.Event) -> str | None:
        """Block until a rank is gone (why) or `closing` is set (None): the monitor thread's wait."""

    def close(self) -> None:
        """Stop ranks 1.. and free what launch took; safe after a failed launch."""


class DistributedExecutor:
    def __init__(self, config: EngineConfig, model_dir: str, transport: RankTransport) -> None:
        from kvtide.worker.model_runner import ModelRunner

        self.config = config
        self.transport = transport
        self.world_size = config.parallel_config.world_size
        self.output_rank = output_rank(config)
        self.dead: str | None = None
        """Why the replica cannot go on (a rank died or failed), or None."""
        self.on_worker_death: Callable[[str], None] | None = None
        """Called once, from the monitor thread, when a rank dies (the engine-core process exits, so
        the API side reports the engine dead at once, even while idle); None: the next step raises."""
        self._closing = threading.Event()
        self._monitor: threading.Thread | None = None
        self._threads_before = torch.get_num_threads()
        self._threads = threads_per_rank(config)
        self._affinity_before = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else None
        pipeline = config.parallel_config.pipeline_parallel_size > 1
        self.tokens = SampledTokenRelay(pipeline)
        self.grammar_ahead = GrammarAhead(config) if pipeline else None
        try:
            init_method = transport.launch(self._gather)
            starting = transport.join(init_method)
            init_rank(config, 0, init_method)
            if transport.device_index is not None:
                torch.cuda.set_device(transport.device_index)
            self.runner = ModelRunner(config, model_dir)
            readies = self._gather(starting, "ready", STARTUP_TIMEOUT_S)
        except BaseException:
            self.shutdown()
            raise
        self._monitor = threading.Thread(target=self._watch_ranks, name="kvtide-rank-monitor", daemon=True)
        self._monitor.start()
        self._kv_bytes_per_block = max([self.runner.kv_bytes_per_block()] + [r[2] for r in readies])
        """The largest rank's bytes per block (pipeline stages differ): each rank's pool of the
        shared block count then fits the per-rank budget."""
        self.weight_bytes_per_rank = [self.runner.weight_bytes] + [r[3] for r in readies]
        pc = config.parallel_config
        logger.info("replica of %d ranks (tp=%d, pp=%d, %s) via %s; weights per rank: %s MiB", pc.world_size,
                    pc.tensor_parallel_size, pc.pipeline_parallel_size, pc.distributed_executor_backend,
                    init_method, ", ".join(f"{b / 2**20:.1f}" for b in self.weight_bytes_per_rank))

    # ---- the executor contract ------------------------------------------------------------------
    def kv_bytes_per_block(self) -> int:
        return self._kv_bytes_per_block

    def collective_rpc(self, method: str, args: tuple = (), kwargs: dict | None = None) -> list:
        raise ValueError(f"{method}: sleep mode and weight updates run on one-rank replicas for now (tensor and "
                         f"pipeline parallelism would need every rank to take its shard)")

    def profile_peak_activation_bytes(self, memory_stats=None) -> int:
        from kvtide.worker.memory_profile import profile_peak_activation_bytes

        sent = self._send(["profile"])
        own = profile_peak_activation_bytes(self.runner, self.config, memory_stats)
        return max([own] + [r[2] for r in self._gather(sent, "profiled", STARTUP_TIMEOUT_S)])

    def initialize_kv_cache(self, num_blocks: int) -> None:
        sent = self._send(["init_kv", num_blocks])
        self.runner.initialize_kv_cache(num_blocks)
        self._gather(sent, "kv_ready", STARTUP_TIMEOUT_S)

    def init_worker_thread(self) -> None:
        """A new thread starts with torch's default thread count, not this rank's."""
        torch.set_num_threads(self._threads)

    def execute(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        return self.execute_async(scheduler_output)()

    def execute_async(self, scheduler_output: SchedulerOutput) -> Callable[[], ModelRunnerOutput]:
        """Send the step to every rank and run rank 0's part of it; returns the call that waits for
        the step's output. Under pipeline parallelism rank 0 is the first stage: once it has passed
        its activations on, the next micro-batch may start here while later stages work on this
        one (outputs come back in launch order)."""
        if self.dead is not None:
            raise WorkerDiedError(self.dead)
        scheduler_output = self.tokens.attach(scheduler_output)
        if self.grammar_ahead is not None:
            scheduler_output = self.grammar_ahead.attach(scheduler_output)
        sent = self._send(["execute", wire.scheduler_output_to_wire(scheduler_output)])
        try:
            output = self.runner.execute(scheduler_output)
        except RuntimeError as e:  # a collective whose peer vanished: name the rank, once it is noticed
            try:
                self._await_lost_rank(sent)
            except WorkerDiedError as died:
                raise died from e
            raise self._died(f"a collective failed: {e}") from e

        def result() -> ModelRunnerOutput:
            replies = self._gather(sent, "output", None)
            if self.output_rank == 0:
                return output
            remote = wire.runner_output_from_wire(replies[0][2])
            self.tokens.record(remote)
            remote.expert_load = merge_expert_load(output.expert_load, remote.expert_load)
            return remote
        return result

    def comm_stats(self) -> dict[int, dict[str, dict[str, float]]]:
        """Every rank's collective counts, bytes and seconds so far (rank -> kind -> figures)."""
        sent = self._send(["comm_stats"])
        stats = {0: self.local_comm_stats()}
        stats.update({r[1]: r[2] for r in self._gather(sent, "comm_stats", 60.0)})
        return stats

    def local_comm_stats(self) -> dict[str, dict[str, float]]:
        """Rank 0's collectives (this process's), without a message to the other ranks."""
        return COMM_STATS.snapshot()

    def replica_lockstep(self) -> None:
        """Replicas that step in lockstep share their experts, and have one rank each."""
        return None

    def shutdown(self) -> None:
        """Stop the other ranks, leave the process group, give this process its threads and cores
        back. Safe to call twice."""
        if self._closing.is_set():
            return
        self._closing.set()
        self.transport.close()
        if self._monitor is not None:
            self._monitor.join(timeout=5)
        destroy_distributed()
        torch.set_num_threads(self._threads_before)
        if self._affinity_before is not None:
            os.sched_setaffinity(0, self._affinity_before)

    # ---- messages -----------------------------------------------------------------------------------
    def _send(self, message: list[Any]) -> Sent:
        return self.transport.send(serialization.encode(message))

    def _gather(self, sent: Sent, kind: str, timeout_s: float | None) -> list[list[Any]]:
        """The `kind` replies to `sent`, in rank order: one from every rank 1.., or for "output" the
        output rank's (none when that is rank 0). Raises WorkerDiedError if a rank reports an error,
        dies, or (with a timeout) stays silent."""
        expected = (1 if self.output_rank != 0 else 0) if kind == "output" else self.world_size - 1
        replies: list[list[Any]] = []
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while len(replies) < expected or self.transport.pending(sent):
            data = self._poll(sent)
            if data is None:
                self._check_ranks()
                if deadline is not None and time.monotonic() > deadline:
                    raise WorkerDiedError(f"the workers sent no {kind!r} within {timeout_s:.0f} s")
                continue
            message = self._reply(data, kind)
            if message is not None:
                replies.append(message)
        return sorted(replies, key=lambda message: message[1])

    def _await_lost_rank(self, sent: Sent) -> None:
        """Raise WorkerDiedError for the rank that failed or died, if one shows within the grace
        period; return if none does."""
        deadline = time.monotonic() + LOST_RANK_GRACE_S
        while time.monotonic() < deadline:
            data = self._poll(sent)
            if data is None:
                self._check_ranks()
            else:
                self._reply(data, "output")

    def _poll(self, sent: Sent) -> bytes | None:
        try:
            return self.transport.poll(sent, POLL_S)
        except WorkerDiedError as e:
            raise self._died(str(e)) from e

    def _reply(self, data: bytes, kind: str) -> list[Any] | None:
        """A rank's reply decoded, None for an empty one; an error report or another kind than
        expected ends the replica."""
        if not data:
            return None
        message = serialization.decode(data)
        if message[0] == "error":
            raise self._died(f"worker rank {message[1]} failed:\n{message[2]}")
        if message[0] != kind:
            raise self._died(f"expected {kind!r} from worker rank {message[1]}, got {message[0]!r}")
        return message

    def _check_ranks(self) -> None:
        if self.dead is not None:
            raise WorkerDiedError(self.dead)
        reason = self.transport.lost_rank()
        if reason is not None:
            raise self._died(reason)

    def _died(self, reason: str) -> WorkerDiedError:
        if self.dead is None:
            self.dead = reason.splitlines()[0]
        return WorkerDiedError(reason)

    def _watch_ranks(self) -> None:
        """The monitor thread: the first rank found gone marks the replica dead."""
        reason = self.transport.wait_for_lost_rank(self._closing)
        if reason is None or self._closing.is_set():
            return
        if self.dead is None:
            self.dead = reason
        logger.error("%s; the replica cannot go on", reason)
        if self.on_worker_death is not None:
            self.on_worker_death(self.dead)
