"""The engine-core process: an EngineCore driven by messages from the API process over ZMQ.

    python -m kvtide.engine.core_proc --input ADDR --output ADDR --parent-pid PID --engine-args-file PATH
        [--dp-rank R --cpu-affinity 0,1 --cpu-threads 2]    (a data-parallel replica, dp_client.py)
    python -m kvtide.engine.core_proc --handshake tcp://HEAD:PORT --dp-rank R --data-parallel-size N ...
        (a replica on a headless node: the head hands it its two addresses, dp_remote.py)

The loop:
    1. take every message waiting on the input socket (block only when no request is unfinished),
    2. apply them: add (all children of one request, or none), abort, stop, utility calls,
    3. if any request is unfinished, run one step and send its outputs.
A request the core refuses (ValueError, a full queue) gets an add_error for its ids; the loop goes
on. An exception inside step() leaves the engine in an unknown state: it is reported ("fatal") and
the process exits non-zero, which the API side sees as a dead engine.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import signal
import sys
import time
import traceback
from collections.abc import Callable
from typing import Any

import zmq

from kvtide.child_process import die_with_parent, set_cpu_share
from kvtide.engine import serialization
from kvtide.engine.core import EngineCore
from kvtide.engine.request import RequestStatus
from kvtide.lora.request import LoRARequest
from kvtide.private_files import read_args_file

logger = logging.getLogger("kvtide.engine.core_proc")

_IDLE_POLL_MS = 1000
"""How long an idle loop blocks on the input socket before it checks that its parent lives."""
_LOCKSTEP_IDLE_POLL_MS = 5
"""The same for replicas in lockstep: a request arriving at one idle replica waits at most this long
for the others to join its first step."""


class EngineCoreProc:
    def __init__(self, core: EngineCore, input_socket: zmq.Socket, output_socket: zmq.Socket,
                 parent_pid: int, head_watch=None) -> None:
        self.core = core
        self.input_socket = input_socket
        self.output_socket = output_socket
        self.parent_pid = parent_pid
        self.head_watch = head_watch
        """A replica on a headless node: its connection to the head (dp_remote.ConnectionWatch)."""
        self.running = True
        # Requests not yet scheduled once: request id -> True. Their first scheduling time goes
        # back with the outputs, so the API side can measure queue time.
        self._unscheduled: set[str] = set()

    # ---- the loop --------------------------------------------------------------------------
    def run(self) -> None:
        while self.running:
            busy = self.core.has_unfinished_requests()
            if self.input_socket.poll(0 if busy else _IDLE_POLL_MS):
                self._handle_pending_messages()
            elif not busy and not self._parent_alive():
                logger.warning("parent process %d is gone; engine core exits", self.parent_pid)
                return
            if self.head_watch is not None and self.head_watch.check():
                logger.warning("the data-parallel head disconnected; engine core exits")
                return
            if self.running and self.core.has_unfinished_requests():
                self._step()

    def run_in_lockstep(self, agree: Callable[[bool, bool], tuple[bool, bool]]) -> None:
        """Experts shared across the data-parallel replicas (one process each): every iteration the
        replicas agree (`agree`, the executor's: this replica has work / stops -> any has / any stops)
        whether any has work and whether any stops; if one has work all step together (an idle one
        through its MoE layers with no tokens), and they stop together, so no replica waits forever
        in an exchange another never enters."""
        while True:
            busy = self.core.has_unfinished_requests()
            if self.input_socket.poll(0 if busy else _LOCKSTEP_IDLE_POLL_MS):
                self._handle_pending_messages()
            elif not busy and not self._parent_alive():
                logger.warning("parent process %d is gone; engine core exits", self.parent_pid)
                self.running = False
            if self.head_watch is not None and self.head_watch.check():
                logger.warning("the data-parallel head disconnected; engine core exits")
                self.running = False
            any_busy, any_stopping = agree(self.core.has_unfinished_requests(), not self.running)
            if any_stopping:
                return
            if any_busy:
                self._step(self.core.step_in_lockstep)

    def _parent_alive(self) -> bool:
        return os.getppid() == self.parent_pid

    def _handle_pending_messages(self) -> None:
        while self.running:
            try:
                data = self.input_socket.recv(zmq.NOBLOCK)
            except zmq.Again:
                return
            self._handle(serialization.decode(data))

    def _step(self, step=None) -> None:
        started = time.time()
        outputs = (step or self.core.step)()
        scheduled = self._newly_scheduled(started)
        if outputs or scheduled:
            self._send(["outputs", outputs, scheduled])

    def _newly_scheduled(self, step_started: float) -> dict[str, float]:
        if not self._unscheduled:
            return {}
        requests = self.core.scheduler.requests
        done = {rid for rid in self._unscheduled
                if rid not in requests or requests[rid].status != RequestStatus.WAITING}
        self._unscheduled -= done
        return {rid: step_started for rid in done}

    def _send(self, message: list[Any]) -> None:
        self.output_socket.send(serialization.encode(message), copy=False)

    # ---- messages --------------------------------------------------------------------------
    def _handle(self, message: list[Any]) -> None:
        kind = message[0]
        if kind == "add":
            self._add(message[1])
        elif kind == "abort":
            ids = [str(r) for r in message[1]]
            self.core.abort_requests(ids)
            self._unscheduled.difference_update(ids)
        elif kind == "stop":
            ids = [str(r) for r in message[1]]
            self.core.stop_requests(ids)
            self._unscheduled.difference_update(ids)
        elif kind == "utility":
            self._utility(message[1], message[2], message[3])
        elif kind == "shutdown":
            self.running = False
        else:
            logger.error("unknown message kind %r ignored", kind)

    def _add(self, wire_requests: list[dict[str, Any]]) -> None:
        from kvtide.scheduler.scheduler import QueueFullError

        ids = [str(w.get("request_id")) for w in wire_requests]
        added: list[str] = []
        try:
            requests = [serialization.request_from_wire(w) for w in wire_requests]
            for request in requests:
                self.core.check_request(request)
            for request in requests:
                self.core.add_request(request)
                added.append(request.request_id)
        except QueueFullError as e:
            self._reject(ids, added, "queue_full", str(e))
            return
        except (ValueError, TypeError, KeyError) as e:
            self._reject(ids, added, "invalid", str(e))
            return
        self._unscheduled.update(added)

    def _reject(self, ids: list[str], added: list[str], kind: str, message: str) -> None:
        if added:
            self.core.abort_requests(added)
        self._send(["add_error", ids, kind, message])

    def _utility(self, call_id: int, method: str, args: list[Any]) -> None:
        try:
            result = self._call(method, args)
        except Exception as e:  # reported to the caller; the engine itself is fine
            self._send(["utility_result", call_id, False, f"{type(e).__name__}: {e}"])
            return
        self._send(["utility_result", call_id, True, result])

    def _call(self, method: str, args: list[Any]) -> Any:
        if method == "ping":
            return "pong"
        if method == "get_stats":
            return dataclasses.asdict(self.core.get_stats())
        if method == "reset_prefix_cache":
            return self.core.reset_prefix_cache()
        if method == "check_integrity":
            self.core.check_integrity()
            return True
        if method == "num_steps":
            return self.core.num_steps
        if method == "add_lora":
            return self.core.add_lora(LoRARequest.from_wire(args[0]))
        if method == "remove_lora":
            self.core.remove_lora(int(args[0]))
            return True
        if method == "comm_stats":  # this process's collectives (a replica sharing experts: their exchanges)
            return self.core.executor.local_comm_stats()
        if method == "sleep":
            self.core.sleep(*args)
            return self.core.sleep_level
        if method == "wake_up":
            self.core.wake_up()
            return self.core.sleep_level
        if method == "sleep_level":
            return self.core.sleep_level
        if method == "update_weights_from_disk":
            return self.core.update_weights(model_dir=args[0])
        raise ValueError(f"unknown utility method {method!r}")


# ---- process entry -------------------------------------------------------------------------------
def run_engine_core(engine_args: dict[str, Any], input_addr: str, output_addr: str, parent_pid: int,
                    remote: Any = None, dp_rank: int | None = None) -> int:
    """Build the engine core and serve it on the two addresses (tcp ones handed over by a remote
    head when `remote`, dp_remote.join_head's grant: then losing the head ends this process)."""
    from kvtide.bootstrap import build_engine_core
    from kvtide.engine_args import EngineArgs

    context = zmq.Context()
    head_watch = None
    if remote:
        from kvtide.engine.dp_remote import connect_data_sockets

        input_socket, output_socket, head_watch = connect_data_sockets(context, remote)
    else:
        input_socket = context.socket(zmq.PULL)
        input_socket.setsockopt(zmq.RCVHWM, 0)
        input_socket.connect(input_addr)
        output_socket = context.socket(zmq.PUSH)
        output_socket.setsockopt(zmq.SNDHWM, 0)
        output_socket.setsockopt(zmq.LINGER, 2000)
        output_socket.connect(output_addr)
    try:
        try:
            core, info = build_engine_core(EngineArgs(**engine_args), dp_rank)
        except ValueError as e:  # a bad checkpoint or flag: the API side prints it as one line
            output_socket.send(serialization.encode(["startup_error", str(e)]))
            return 1
        except Exception as e:
            logger.exception("engine core failed to start")
            output_socket.send(serialization.encode(["startup_error", f"{type(e).__name__}: {e}"]))
            return 1
        # A rank of the replica died: so does the engine (the API side then reports it dead at once).
        core.executor.on_worker_death = lambda reason: os._exit(1)
        cache = core.config.cache_config
        ready = dict(dataclasses.asdict(info), num_blocks=cache.num_blocks, block_size=cache.block_size,
                     pid=os.getpid())
        output_socket.send(serialization.encode(["ready", ready]))
        proc = EngineCoreProc(core, input_socket, output_socket, parent_pid, head_watch)
        try:
            lockstep = core.executor.replica_lockstep()
            if lockstep is None:
                proc.run()
            else:
                proc.run_in_lockstep(lockstep)
        except Exception as e:
            logger.exception("engine core step failed")
            output_socket.send(serialization.encode(["fatal", f"{type(e).__name__}: {e}\n"
                                                              f"{traceback.format_exc(limit=5)}"]))
            return 1
        finally:
            core.shutdown()
        return 0
    finally:
        if head_watch is not None:
            head_watch.close()
        input_socket.close(linger=0)
        output_socket.close()
        context.term()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kvtide.engine.core_proc")
    parser.add_argument("--input", default=None, help="ZMQ address the API process pushes requests to")
    parser.add_argument("--output", default=None, help="ZMQ address outputs are pushed to")
    parser.add_argument("--handshake", default=None,
                        help="instead of --input/--output: a data-parallel head's tcp address to join")
    parser.add_argument("--data-parallel-size", type=int, default=None, help="with --handshake: the head's")
    parser.add_argument("--handshake-timeout", type=float, default=600.0,
                        help="with --handshake: seconds to wait for the head")
    parser.add_argument("--expert-group", default=None,
                        help="torch.distributed init method of the replicas' shared expert-parallel group "
                             "(with --dp-rank and --data-parallel-size)")
    parser.add_argument("--parent-pid", type=int, required=True)
    parser.add_argument("--engine-args-file", default=None,
                        help="a 0600 JSON file of EngineArgs fields, read and deleted at start: the args may "
                             "hold secrets, which a command line shows to every local user")
    parser.add_argument("--engine-args", default=None, help="EngineArgs fields as a JSON object (shown by ps)")
    parser.add_argument("--dp-rank", type=int, default=None, help="data-parallel replica index (log lines)")
    parser.add_argument("--cpu-affinity", default=None, help="CPUs this process may run on, e.g. 0,1")
    parser.add_argument("--cpu-threads", type=int, default=None, help="torch intra-op threads")
    args = parser.parse_args(argv)
    if (args.engine_args is None) == (args.engine_args_file is None):
        parser.error("give one of --engine-args-file and --engine-args")
    engine_args = json.loads(args.engine_args) if args.engine_args is not None \
        else read_args_file(args.engine_args_file)
    if args.handshake is None and (args.input is None or args.output is None):
        parser.error("give --input and --output, or --handshake")
    if args.handshake is not None and (args.dp_rank is None or args.data_parallel_size is None):
        parser.error("--handshake needs --dp-rank and --data-parallel-size")
    die_with_parent()
    # Ctrl-C in a terminal, `timeout`, `docker stop` signal the whole process group: the API
    # process drains first and then stops us. Without a parent, a signal ends us at once. A
    # headless node's launcher forwards its signals: no API process there to drain.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, lambda *_: None if os.getppid() == args.parent_pid and args.handshake is None
                  else sys.exit(0))
    tag = "engine-core" if args.dp_rank is None else f"engine-core DP{args.dp_rank}"
    logging.basicConfig(level=os.environ.get("KVTIDE_LOG_LEVEL", "INFO"),
                        format=f"%(asctime)s %(levelname)s [{tag}] %(name)s: %(message)s")
    if os.getppid() != args.parent_pid:
        return 1
    set_cpu_share(args.cpu_affinity, args.cpu_threads)
    input_addr, output_addr, expert_group = args.input, args.output, args.expert_group
    grant = None
    if args.handshake is not None:
        from kvtide.engine.dp_remote import join_head

        try:
            grant = join_head(args.handshake, args.dp_rank, args.data_parallel_size, args.handshake_timeout)
            input_addr, output_addr, expert_group = grant.input_addr, grant.output_addr, grant.expert_group
        except (RuntimeError, ValueError) as e:
            logger.error("%s", e)
            return 1
    if expert_group is not None:
        if args.dp_rank is None or args.data_parallel_size is None:
            parser.error("--expert-group needs --dp-rank and --data-parallel-size")
        from kvtide.bootstrap import join_replica_expert_group

        join_replica_expert_group(args.dp_rank, args.data_parallel_size, expert_group,
                                  engine_args.get("device", "auto"))
    return run_engine_core(engine_args, input_addr, output_addr, args.parent_pid, remote=grant, dp_rank=args.dp_rank)


if __name__ == "__main__":
    exit_code = main()
    # Tearing down torch and transformers modules takes seconds and has nothing left to flush.
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(exit_code)
