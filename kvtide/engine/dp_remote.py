"""Multi-node data parallelism: replicas on other nodes join the head's API server over TCP.

    head node (API server)                                headless node
    kvtide serve M --data-parallel-size 4                 kvtide serve M --headless --data-parallel-size 4
        --data-parallel-size-local 2                          --data-parallel-size-local 2
        --data-parallel-address 10.0.0.1                      --data-parallel-start-rank 2
        --data-parallel-rpc-port 29550                        --data-parallel-address 10.0.0.1
                                                              --data-parallel-rpc-port 29550
    ranks 0, 1: local engine cores (ipc)
    ROUTER tcp://10.0.0.1:29550  ◀── hello [rank] ─────── ranks 2, 3: engine cores (core_proc --handshake)
                                 ─── welcome [in, out] ─▶
    PUSH  tcp://10.0.0.1:<in>    ─── requests ─────────▶  PULL
    PULL  tcp://10.0.0.1:<out>   ◀── outputs, ready ────  PUSH

The handshake only hands a joining engine core the two data addresses the head bound for its rank;
from then on it is the same protocol as a local replica's (msgspec msgpack, never pickle), and the
head's EngineCoreClient for it differs only in its process handle (RemoteEngineProcess): the head
cannot signal a process on another node, so "exited" means its connection dropped (ZMQ's
connection events, with ZMQ heartbeats for a node that vanished without closing it), and the
watchdog's pings cover a wedged one. Either way the whole engine is dead, as with a local replica.
An engine core whose head went away exits; its headless launcher exits once all of its cores have.
Each node uses its own model path and flags; the head refuses replicas whose model shape differs.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import asdict
from typing import Any

import zmq
import zmq.asyncio
from zmq.utils.monitor import parse_monitor_message

from kvtide.engine import serialization
from kvtide.engine.core_client import EngineCoreClient

logger = logging.getLogger(__name__)

DEFAULT_RPC_PORT = 29550
"""--data-parallel-rpc-port when not given (vLLM's default)."""
HEARTBEAT_IVL_MS = 1000
HEARTBEAT_TIMEOUT_MS = 10_000
"""ZMQ heartbeats on the TCP connections: a peer whose node vanished (no FIN ever comes) is seen
gone after this long, as a dropped connection."""
_SHAPE_FIELDS = ("vocab_size", "max_model_len", "block_size", "eos_token_ids")
"""What every replica must agree on: requests are validated and detokenized once, by the head."""


def rpc_address(args: Any) -> str:
    host = args.data_parallel_address or "127.0.0.1"
    return f"tcp://{host}:{args.data_parallel_rpc_port or DEFAULT_RPC_PORT}"


def _tcp_socket(context: zmq.Context, kind: int) -> zmq.Socket:
    sock = context.socket(kind)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.HEARTBEAT_IVL, HEARTBEAT_IVL_MS)
    sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, HEARTBEAT_TIMEOUT_MS)
    return sock


class ConnectionWatch:
    """Whether a socket's one peer is still connected, from ZMQ's monitor events, read without
    blocking (a sync view of the monitor socket, so it works for asyncio sockets too)."""

    def __init__(self, sock: zmq.Socket) -> None:
        self._monitor = sock.get_monitor_socket(zmq.EVENT_ACCEPTED | zmq.EVENT_CONNECTED | zmq.EVENT_DISCONNECTED)
        self._view = zmq.Socket.shadow(self._monitor.underlying)
        self._sock = sock
        self.connected = False
        self.dropped = False

    def check(self) -> bool:
        """True once the peer that connected has gone."""
        while not self.dropped:
            try:
                event = parse_monitor_message(self._view.recv_multipart(zmq.NOBLOCK))["event"]
            except zmq.Again:
                break
            if event in (zmq.EVENT_ACCEPTED, zmq.EVENT_CONNECTED):
                self.connected = True
            elif event == zmq.EVENT_DISCONNECTED and self.connected:
                self.dropped = True
        return self.dropped

    def close(self) -> None:
        """Before the socket's context is terminated (an open monitor would block that)."""
        with contextlib.suppress(zmq.ZMQError):
            self._sock.disable_monitor()
        self._monitor.close(linger=0)


class RemoteEngineProcess:
    """The subprocess.Popen surface EngineCoreClient uses, for an engine core on another node:
    running while its connection stands. terminate/kill cannot reach it: the client's shutdown
    message is the only way to stop it, and a dropped connection is its exit."""

    def __init__(self, rank: int, node: str, watch: ConnectionWatch) -> None:
        self.rank = rank
        self.node = node
        self.pid: int | None = None
        """The engine core's pid on its node, once it is ready."""
        self.returncode: int | None = None
        self.exit_reason: str | None = None
        self._watch = watch

    def poll(self) -> int | None:
        if self.returncode is None and self._watch.check():
            self.returncode = -1
            self.exit_reason = (f"data-parallel engine {self.rank} on {self.node} (pid {self.pid}) "
                                f"disconnected")
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(f"data-parallel engine {self.rank}", timeout)
            time.sleep(0.05)
        return self.returncode

    def terminate(self) -> None:
        pass

    def kill(self) -> None:
        pass

    def close(self) -> None:
        self._watch.close()


# ---- the head ------------------------------------------------------------------------------------
class RemoteReplicaListener:
    """The head's rendezvous: bound before the local replicas start (so nodes may join while they
    load), it welcomes each expected rank once, and closes when all have joined."""

    def __init__(self, args: Any, ranks: range, expert_group: str | None = None) -> None:
        self.args = args
        self.ranks = ranks
        self.expert_group = expert_group
        """The init method of the replicas' shared expert-parallel group, handed to each joiner."""
        self.address = rpc_address(args)
        self.host = args.data_parallel_address or "127.0.0.1"
        self._context = zmq.asyncio.Context()
        self._router = _tcp_socket(self._context, zmq.ROUTER)
        try:
            self._router.bind(self.address)
        except zmq.ZMQError as e:
            self._context.destroy(linger=0)
            raise ValueError(f"cannot bind the data-parallel rendezvous at {self.address} ({e}): pick another "
                             f"--data-parallel-rpc-port, or an address of this node") from e
        if self.host in ("127.0.0.1", "localhost"):
            logger.warning("data-parallel rendezvous on %s: only replicas on this node can reach it; give "
                           "--data-parallel-address an address the other nodes reach", self.address)
        logger.info("waiting for data-parallel ranks %d..%d to join at %s", ranks.start, ranks.stop - 1,
                    self.address)

    async def accept(self, startup_timeout_s: float, engine_timeout_s: float | None) -> list[EngineCoreClient]:
        """Welcome every expected rank, then wait until each is ready; their clients in rank order."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + startup_timeout_s
        clients: dict[int, EngineCoreClient] = {}
        ready: list[asyncio.Task] = []
        try:
            while len(clients) < len(self.ranks):
                left = deadline - loop.time()
                if left <= 0:
                    missing = [r for r in self.ranks if r not in clients]
                    raise RuntimeError(
                        f"data-parallel ranks {missing} did not join {self.address} within {startup_timeout_s:.0f} s: "
                        f"start them on their node with `kvtide serve MODEL --headless --data-parallel-size "
                        f"{self.args.data_parallel_size} --data-parallel-size-local N --data-parallel-start-rank R "
                        f"--data-parallel-address {self.host} --data-parallel-rpc-port "
                        f"{self.address.rsplit(':', 1)[1]}`")
                if not await self._router.poll(timeout=int(min(left, 1.0) * 1000)):
                    continue
                identity, payload = await self._router.recv_multipart()
                joined = self._welcome(identity, payload, clients, engine_timeout_s)
                if joined is not None:
                    rank, client = joined
                    clients[rank] = client
                    ready.append(loop.create_task(client.wait_ready(max(1.0, deadline - loop.time()))))
            await asyncio.gather(*ready)
        except BaseException:
            for task in ready:
                task.cancel()
            await asyncio.gather(*ready, return_exceptions=True)
            for client in clients.values():
                client.shutdown(timeout_s=2.0)
            raise
        finally:
            self.close()
        ordered = [clients[r] for r in self.ranks]
        for client in ordered:
            client.proc.pid = client.info.pid
        return ordered

    def _welcome(self, identity: bytes, payload: bytes, joined: dict, engine_timeout_s: float | None):
        """A hello: (rank, its client) with the data sockets bound, or None after a refusal."""
        try:
            kind, rank, size, node = serialization.decode(payload)
        except (ValueError, TypeError) as e:
            logger.warning("ignored a malformed join message at %s (%s)", self.address, e)
            return None
        reason = None
        if kind != "hello":
            reason = f"expected hello, got {kind!r}"
        elif size != self.args.data_parallel_size:
            reason = f"data_parallel_size {size} differs from the head's {self.args.data_parallel_size}"
        elif rank not in self.ranks:
            reason = f"rank {rank} is not one this head waits for ({self.ranks.start}..{self.ranks.stop - 1})"
        elif rank in joined:
            reason = f"rank {rank} has already joined"
        if reason is not None:
            logger.error("refused a data-parallel replica from %s: %s", node, reason)
            self._router.send_multipart([identity, serialization.encode(["refused", reason])])
            return None
        context = zmq.asyncio.Context()  # the client's own: its shutdown terminates it
        input_socket = _tcp_socket(context, zmq.PUSH)
        input_socket.setsockopt(zmq.SNDHWM, 0)
        output_socket = _tcp_socket(context, zmq.PULL)
        output_socket.setsockopt(zmq.RCVHWM, 0)
        watch = ConnectionWatch(output_socket)
        input_socket.bind(f"tcp://{self.host}:*")
        output_socket.bind(f"tcp://{self.host}:*")
        addresses = [input_socket.getsockopt_string(zmq.LAST_ENDPOINT),
                     output_socket.getsockopt_string(zmq.LAST_ENDPOINT)]
        self._router.send_multipart([identity, serialization.encode(["welcome", *addresses, self.expert_group])])
        logger.info("data-parallel engine %d joined from %s", rank, node)
        client = EngineCoreClient(RemoteEngineProcess(rank, str(node), watch), context, input_socket,
                                  output_socket, [], engine_timeout_s)
        return rank, client

    def close(self) -> None:
        self._router.close(linger=0)
        self._context.term()


def check_same_model(clients: list[EngineCoreClient]) -> None:
    """Replicas started from each node's own flags must agree on what the head validates and
    detokenizes with."""
    first = clients[0].info
    for rank, client in enumerate(clients[1:], start=1):
        for name in _SHAPE_FIELDS:
            if getattr(client.info, name) != getattr(first, name):
                raise ValueError(f"data-parallel engine {rank} has {name}={getattr(client.info, name)!r}, engine 0 "
                                 f"{getattr(first, name)!r}: every node must serve the same model with the same "
                                 f"--max-model-len and --block-size")


# ---- a joining engine core -------------------------------------------------------------------------
def join_head(address: str, rank: int, data_parallel_size: int, timeout_s: float) -> tuple[str, str, str | None]:
    """An engine core on a headless node: say hello to the head, get this rank's two addresses
    (and the shared experts' group, if the replicas share theirs)."""
    context = zmq.Context.instance()
    dealer = _tcp_socket(context, zmq.DEALER)
    try:
        dealer.connect(address)
        dealer.send(serialization.encode(["hello", rank, data_parallel_size, socket.gethostname()]))
        if not dealer.poll(int(timeout_s * 1000)):
            raise RuntimeError(f"no data-parallel head answered at {address} within {timeout_s:.0f} s")
        answer = serialization.decode(dealer.recv())
    finally:
        dealer.close(linger=0)
    if answer[0] != "welcome":
        raise RuntimeError(f"the data-parallel head at {address} refused rank {rank}: {answer[1]}")
    return answer[1], answer[2], answer[3]


def connect_data_sockets(context: zmq.Context, input_addr: str, output_addr: str):
    """The joining core's PULL (requests) and PUSH (outputs), with a watch that tells when the
    head has gone (then the core exits)."""
    input_socket = _tcp_socket(context, zmq.PULL)
    input_socket.setsockopt(zmq.RCVHWM, 0)
    watch = ConnectionWatch(input_socket)
    input_socket.connect(input_addr)
    output_socket = _tcp_socket(context, zmq.PUSH)
    output_socket.setsockopt(zmq.SNDHWM, 0)
    output_socket.setsockopt(zmq.LINGER, 2000)
    output_socket.connect(output_addr)
    return input_socket, output_socket, watch


# ---- the headless node ------------------------------------------------------------------------------
def run_headless(engine_args: Any, startup_timeout_s: float = 600.0) -> int:
    """`kvtide serve MODEL --headless ...`: start this node's replicas, each joining the head; exit
    when all have exited (the head shut them down or went away). SIGINT/SIGTERM stop them."""
    from kvtide.engine.dp_client import omp_threads_env, plan_replicas, uses_cuda, visible_gpus

    local = engine_args.data_parallel_size_local
    start = engine_args.data_parallel_start_rank
    world = engine_args.tensor_parallel_size * engine_args.pipeline_parallel_size
    cuda = uses_cuda(engine_args.device)
    placements = plan_replicas(local, "cuda" if cuda else "cpu", world, engine_args.cpu_threads_per_rank,
                               visible_gpus=visible_gpus() if cuda else None, omp_threads=omp_threads_env())
    replica_args = engine_args.replace(data_parallel_size=1, data_parallel_size_local=None, data_parallel_start_rank=0,
                                       data_parallel_address=None, data_parallel_rpc_port=None)
    args_json = json.dumps(asdict(replica_args))
    address = rpc_address(engine_args)
    procs: list[subprocess.Popen] = []
    for p in placements:
        rank = start + p.rank
        command = [sys.executable, "-m", "kvtide.engine.core_proc", "--handshake", address,
                   "--data-parallel-size", str(engine_args.data_parallel_size), "--handshake-timeout",
                   str(startup_timeout_s), "--parent-pid", str(os.getpid()), "--engine-args", args_json,
                   "--dp-rank", str(rank)]
        if p.cpu_threads is not None:
            command += ["--cpu-threads", str(p.cpu_threads)]
        if p.cpu_affinity:
            command += ["--cpu-affinity", ",".join(str(c) for c in p.cpu_affinity)]
        logger.info("data-parallel engine %d: joining %s", rank, address)
        procs.append(subprocess.Popen(command, stdin=subprocess.DEVNULL,
                                      env={**os.environ, **p.env} if p.env else None))

    def stop(*_):
        for proc in procs:
            if proc.poll() is None:
                proc.terminate()

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    codes = [proc.wait() for proc in procs]
    failed = [(start + i, c) for i, c in enumerate(codes) if c != 0]
    if failed:
        logger.error("data-parallel engines exited with errors: %s",
                     ", ".join(f"rank {r}: code {c}" for r, c in failed))
        return 1
    logger.info("all data-parallel engines of this node have exited")
    return 0
