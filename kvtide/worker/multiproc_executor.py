"""The multiprocess executor: one replica of tensor_parallel_size x pipeline_parallel_size ranks on
this node. Rank 0 runs in the engine core's own process, beside structured output's matchers (it
applies them under tensor parallelism; under pipeline parallelism the last stage samples, and the
step's drafts and token bitmask are computed here ahead of it, `GrammarAhead`); ranks 1.. are
spawned worker processes (worker.py). Each step the scheduler's
output goes to every worker as msgpack over ZMQ, every rank runs the same step (collectives in
the same order), and the output rank's ModelRunnerOutput comes back: rank 0's own under tensor
parallelism, the last stage's over ZMQ under pipeline parallelism.

A worker that dies is noticed within a second (its process is polled while the executor waits,
and the ranks blocked in a collective with it see their connection reset): the step raises, and
the engine reports itself dead.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

import torch
import zmq

from kvtide.config import EngineConfig
from kvtide.distributed import COMM_STATS, destroy_distributed
from kvtide.engine import serialization
from kvtide.private_files import private_dir, remove_private_dir, write_args_file
from kvtide.scheduler.output import ModelRunnerOutput, SchedulerOutput
from kvtide.worker import wire
from kvtide.worker.worker import free_port, init_rank, output_rank, threads_per_rank

logger = logging.getLogger(__name__)

STARTUP_TIMEOUT_S = 600.0
"""How long the workers may take to load their shards and answer."""


class WorkerDiedError(RuntimeError):
    """A rank of the replica exited or reported an error; the replica cannot go on."""


class MultiprocExecutor:
    def __init__(self, config: EngineConfig, model_dir: str, engine_args: dict[str, Any]) -> None:
        """`engine_args`: the EngineArgs `config` came from, as a dict (workers rebuild it)."""
        from kvtide.worker.model_runner import ModelRunner

        self.config = config
        world = config.parallel_config.world_size
        self.output_rank = output_rank(config)
        self._threads_before = torch.get_num_threads()
        init_method = f"tcp://127.0.0.1:{free_port()}"
        self._ctx = zmq.Context()
        # Sockets and the workers' args files in a directory only this user can enter (the args may
        # hold secrets: they never go on a command line).
        self._private_dir = private_dir("kvtide-workers-")
        base = os.path.join(self._private_dir, "w")
        self._inboxes: list[zmq.Socket] = []
        self._outbox = self._ctx.socket(zmq.PULL)
        self._outbox.bind(f"ipc://{base}-out")
        self.workers: list[subprocess.Popen] = []
        for rank in range(1, world):
            inbox = self._ctx.socket(zmq.PUSH)
            inbox.bind(f"ipc://{base}-in{rank}")
            self._inboxes.append(inbox)
            self.workers.append(subprocess.Popen(
                [sys.executable, "-m", "kvtide.worker.worker", "--engine-args-file",
                 write_args_file(engine_args, self._private_dir), "--model-dir", model_dir,
                 "--rank", str(rank), "--init-method", init_method, "--input", f"ipc://{base}-in{rank}",
                 "--output", f"ipc://{base}-out", "--parent-pid", str(os.getpid())]))
        self._threads = threads_per_rank(config)
        self._affinity_before = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else None
        self.dead: str | None = None
        """Why the replica cannot go on (a worker died), or None."""
        self.on_worker_death: Callable[[str], None] | None = None
        """Called from the monitor thread when a worker dies (the engine-core process exits, so the
        API side reports the engine dead at once, even while idle); None: the next step raises."""
        self._closing = threading.Event()
        self.tokens = SampledTokenRelay(config.parallel_config.pipeline_parallel_size > 1)
        self.grammar_ahead = GrammarAhead(config) if config.parallel_config.pipeline_parallel_size > 1 else None
        try:
            self._gather("prepared", STARTUP_TIMEOUT_S)
            init_rank(config, 0, init_method)
            self.runner = ModelRunner(config, model_dir)
            readies = self._gather("ready", STARTUP_TIMEOUT_S)
        except BaseException:
            self.shutdown()
            raise
        threading.Thread(target=self._monitor, name="kvtide-worker-monitor", daemon=True).start()
        self._kv_bytes_per_block = max([self.runner.kv_bytes_per_block()] + [r[2] for r in readies])
        """The largest rank's bytes per block (pipeline stages differ): each rank's pool of the
        shared block count then fits the per-rank budget."""
        self.weight_bytes_per_rank = [self.runner.weight_bytes] + [r[3] for r in sorted(readies, key=lambda r: r[1])]
        logger.info("replica of %d ranks (tp=%d, pp=%d); weights per rank: %s MiB", world,
                    config.parallel_config.tensor_parallel_size, config.parallel_config.pipeline_parallel_size,
                    ", ".join(f"{b / 2**20:.1f}" for b in self.weight_bytes_per_rank))

    # ---- the executor contract ------------------------------------------------------------------
    def kv_bytes_per_block(self) -> int:
        return self._kv_bytes_per_block

    def profile_peak_activation_bytes(self, memory_stats=None) -> int:
        from kvtide.worker.memory_profile import profile_peak_activation_bytes

        self._broadcast(["profile"])
        own = profile_peak_activation_bytes(self.runner, self.config, memory_stats)
        return max([own] + [r[2] for r in self._gather("profiled", STARTUP_TIMEOUT_S)])

    def initialize_kv_cache(self, num_blocks: int) -> None:
        self._broadcast(["init_kv", num_blocks])
        self.runner.initialize_kv_cache(num_blocks)
        self._gather("kv_ready", STARTUP_TIMEOUT_S)

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
        self._broadcast(["execute", wire.scheduler_output_to_wire(scheduler_output)])
        try:
            output = self.runner.execute(scheduler_output)
        except RuntimeError as e:  # a collective whose peer vanished: name the rank once it is reaped
            deadline = time.monotonic() + 2.0
            while time.monotonic() < deadline:
                self._check_workers()
                time.sleep(0.05)
            raise WorkerDiedError(f"a collective failed: {e}") from e
        if self.output_rank == 0:
            return lambda: output

        def result() -> ModelRunnerOutput:
            remote = wire.runner_output_from_wire(self._gather("output", None)[0][2])
            self.tokens.record(remote)
            remote.expert_load = merge_expert_load(output.expert_load, remote.expert_load)
            return remote
        return result

    def comm_stats(self) -> dict[int, dict[str, dict[str, float]]]:
        """Every rank's collective counts, bytes and seconds so far (rank -> kind -> figures)."""
        self._broadcast(["comm_stats"])
        stats = {0: COMM_STATS.snapshot()}
        stats.update({r[1]: r[2] for r in self._gather("comm_stats", 60.0)})
        return stats

    def shutdown(self) -> None:
        self._closing.set()
        for inbox in self._inboxes:
            try:
                inbox.send(serialization.encode(["shutdown"]), zmq.NOBLOCK)
            except zmq.ZMQError:
                pass
        for proc in self.workers:
            try:
                proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=5)
        self.workers = []
        self._ctx.destroy(linger=0)
        remove_private_dir(self._private_dir)
        destroy_distributed()
        torch.set_num_threads(self._threads_before)
        if self._affinity_before is not None:
            os.sched_setaffinity(0, self._affinity_before)

    def _monitor(self) -> None:
        """Poll the workers twice a second; the first one found exited marks the replica dead."""
        while not self._closing.wait(0.5):
            try:
                self._check_workers()
            except WorkerDiedError as e:
                if self._closing.is_set():
                    return
                self.dead = str(e)
                logger.error("%s; the engine cannot go on", e)
                if self.on_worker_death is not None:
                    self.on_worker_death(self.dead)
                return

    # ---- messages -----------------------------------------------------------------------------------
    def _broadcast(self, message: list[Any]) -> None:
        data = serialization.encode(message)
        for inbox in self._inboxes:
            inbox.send(data)

    def _check_workers(self) -> None:
        for rank, proc in enumerate(self.workers, start=1):
            if proc.poll() is not None:
                raise WorkerDiedError(f"worker rank {rank} exited (code {proc.returncode})")

    def _gather(self, kind: str, timeout_s: float | None) -> list[list[Any]]:
        """The `kind` replies: one from every worker, or for "output" the output rank's; raises if a
        worker reports an error, dies, or (with a timeout) stays silent."""
        expected = 1 if kind == "output" else len(self.workers)
        replies: list[list[Any]] = []
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while len(replies) < expected:
            if self._outbox.poll(200):
                message = serialization.decode(self._outbox.recv())
                if message[0] == "error":
                    raise WorkerDiedError(f"worker rank {message[1]} failed:\n{message[2]}")
                if message[0] != kind:
                    raise WorkerDiedError(f"expected {kind!r} from the workers, got {message[0]!r}")
                replies.append(message)
                continue
            self._check_workers()
            if deadline is not None and time.monotonic() > deadline:
                raise WorkerDiedError(f"the workers sent no {kind!r} within {timeout_s:.0f} s")
        return replies


class SampledTokenRelay:
    """Under pipeline parallelism only the last stage samples; the earlier stages (rank 0 among
    them) learn each request's tokens from the request's next step (CachedRequestData.
    sampled_token_ids), which this relay fills from the outputs it has seen (with speculative
    decoding a step's accepted drafts, then its sampled token: every stage then proposes n-gram
    drafts from the same tokens). Tokens of a request
    that is sent again in full (after preemption) or finished are dropped: the full copy has them."""

    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled
        self._pending: dict[str, list[int]] = {}
        self._live: set[str] = set()

    def record(self, output: ModelRunnerOutput) -> None:
        if not self.enabled:
            return
        for req_id, token in output.sampled_token_ids.items():
            if req_id in self._live:  # speculative decoding: the accepted drafts came first
                self._pending.setdefault(req_id, []).extend(output.spec_token_ids.get(req_id, []) + [token])
        for req_id in output.failed:  # the sampling stage appended a placeholder for it
            if req_id in self._live:
                self._pending.setdefault(req_id, []).append(0)

    def attach(self, so: SchedulerOutput) -> SchedulerOutput:
        if not self.enabled:
            return so
        for req_id in so.finished_req_ids:
            self._live.discard(req_id)
            self._pending.pop(req_id, None)
        for new in so.scheduled_new_reqs:
            self._live.add(new.request_id)
            self._pending.pop(new.request_id, None)
        if not self._pending:
            return so
        cached = [dataclasses.replace(c, sampled_token_ids=self._pending.pop(c.request_id))
                  if c.request_id in self._pending else c for c in so.scheduled_cached_reqs]
        return dataclasses.replace(so, scheduled_cached_reqs=cached)


class GrammarAhead:
    """Structured output under pipeline parallelism: the last stage samples, in another process than
    the matchers. Before each step the engine core cuts the constrained requests' drafts and fills
    their token bitmask rows (structured_output/step.py `GrammarStep.ahead`, the same calls the
    runner makes at world size 1), and every rank takes that StepBitmask with the step. The drafts
    are n-gram ones, the only method pipelines run: proposed here from the scheduler's tokens, which
    are every stage's tokens (no step is scheduled ahead of a constrained request's token), so they
    equal what each rank proposes."""

    def __init__(self, config: EngineConfig) -> None:
        spec = config.speculative_config
        self._propose = None
        if spec is not None:
            from kvtide.spec_decode.ngram import NgramProposer

            assert spec.method == "ngram", "pipeline parallelism runs n-gram drafts only"
            self._propose = NgramProposer(spec.prompt_lookup_min, spec.prompt_lookup_max).propose_one

    def attach(self, so: SchedulerOutput) -> SchedulerOutput:
        if so.grammar is None:
            return so
        return dataclasses.replace(so, grammar=so.grammar.ahead(so.num_draft_tokens, self._propose))


def merge_expert_load(first: dict | None, last: dict | None) -> dict | None:
    """The first and last pipeline stages' per-layer expert load as one report (each stage counts
    only its own layers; a stage between them is not reported)."""
    if first is None or last is None:
        return last if first is None else first
    return {key: first[key] + last[key] for key in ("layers", "tokens", "dropped")}
