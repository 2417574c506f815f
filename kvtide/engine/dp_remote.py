"""Multi-node data parallelism: replicas on other nodes join the head's API server over TCP.

    head node (API server)                                headless node
    kvtide serve M --data-parallel-size 4                 kvtide serve M --headless --data-parallel-size 4
        --data-parallel-size-local 2                          --data-parallel-size-local 2
        --data-parallel-address 10.0.0.1                      --data-parallel-start-rank 2
        --data-parallel-rpc-port 29550                        --data-parallel-address 10.0.0.1
                                                              --data-parallel-rpc-port 29550
    ranks 0, 1: local engine cores (ipc)
    ROUTER tcp://10.0.0.1:29550  ◀── hello [rank, nonce] ─ ranks 2, 3: engine cores (core_proc --handshake)
                                 ── challenge [nonce, proof] ▶
                                 ◀── auth [MAC, CURVE key] ─
                                 ─── welcome [in, out, server key, MAC] ─▶
    PUSH  tcp://10.0.0.1:<in>    ═══ requests (CURVE) ══▶  PULL
    PULL  tcp://10.0.0.1:<out>   ◀══ outputs, ready ════  PUSH

The join is a challenge-response under the deployment's secret ($KVTIDE_DP_SECRET, dp_auth.py),
proven both ways; a peer that fails it is refused and logged with its address, and never learns a
data address. The data sockets the head binds for a rank are CURVE servers (encrypted) that admit
only the client key the joiner sent inside its authenticated answer, so a stranger who finds the
ports can neither take requests from them nor send outputs into them. Every socket here bounds
the messages it takes from the network (ZMQ_MAXMSGSIZE, refused from the length header).

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
import logging
import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from typing import Any

import zmq
import zmq.asyncio
from zmq.auth.thread import ThreadAuthenticator
from zmq.utils.monitor import parse_monitor_message

from kvtide.engine import serialization
from kvtide.engine.core_client import EngineCoreClient
from kvtide.engine.dp_auth import SECRET_ENV, data_parallel_secret, head_proof, join_mac, welcome_mac
from kvtide.engine.dp_placement import place_local_replicas
from kvtide.net_auth import new_nonce, same_mac
from kvtide.private_files import write_args_file

logger = logging.getLogger(__name__)

DEFAULT_RPC_PORT = 29550
"""--data-parallel-rpc-port when not given (vLLM's default)."""
HEARTBEAT_IVL_MS = 1000
HEARTBEAT_TIMEOUT_MS = 10_000
"""ZMQ heartbeats on the TCP connections: a peer whose node vanished (no FIN ever comes) is seen
gone after this long, as a dropped connection."""
_SHAPE_FIELDS = ("vocab_size", "max_model_len", "block_size", "eos_token_ids")
"""What every replica must agree on: requests are validated and detokenized once, by the head."""
JOIN_MAX_MESSAGE_BYTES = 64 * 1024
"""Largest frame the rendezvous takes (ZMQ_MAXMSGSIZE): a hello or an answer is under 300 bytes."""
JOIN_MAX_FRAMES = 2
"""Frames of a join message (identity, payload); a message of more is refused."""
DATA_MAX_MESSAGE_BYTES = 1 << 30
"""Largest message a data socket takes: above any legitimate one (a step's outputs with the prompt
logprobs of a million-token prompt are ~300 MB; a request is its token ids). Only the
authenticated replica can send on these sockets at all: this bounds a faulty peer."""
MAX_PENDING_JOINS = 64
"""Hellos answered with a challenge and not yet answered back; past it the oldest is forgotten."""
JOIN_CHALLENGE_TTL_S = 30.0
"""How long a challenge may go unanswered."""
_ZAP_DOMAIN = b"kvtide-dp"


def rpc_address(args: Any) -> str:
    host = args.data_parallel_address or "127.0.0.1"
    return f"tcp://{host}:{args.data_parallel_rpc_port or DEFAULT_RPC_PORT}"


def _tcp_socket(context: zmq.Context, kind: int, max_message_bytes: int = DATA_MAX_MESSAGE_BYTES) -> zmq.Socket:
    sock = context.socket(kind)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.HEARTBEAT_IVL, HEARTBEAT_IVL_MS)
    sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, HEARTBEAT_TIMEOUT_MS)
    sock.setsockopt(zmq.MAXMSGSIZE, max_message_bytes)
    return sock


class ConnectionWatch:
    """Whether a socket's one peer is still connected, from ZMQ's monitor events, read without
    blocking (a sync view of the monitor socket, so it works for asyncio sockets too).

    The peer is the connection whose handshake (CURVE, the allowed key) succeeded. Others may
    connect to a bound socket and fail theirs (a port scan): their coming and going is not the
    peer's. Events name connections by file descriptor, except the handshake's: the peer is one of
    the connections open when it succeeded, and it has gone when all of those have."""

    def __init__(self, sock: zmq.Socket) -> None:
        self._monitor = sock.get_monitor_socket(zmq.EVENT_ACCEPTED | zmq.EVENT_CONNECTED
                                                | zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_DISCONNECTED)
        self._view = zmq.Socket.shadow(self._monitor.underlying)
        self._sock = sock
        self._open: set[int] = set()
        self._peer: set[int] | None = None
        """The connections one of which is the peer's, from its handshake on."""
        self.connected = False
        self.dropped = False

    def check(self) -> bool:
        """True once the peer that connected has gone."""
        while not self.dropped:
            try:
                event = parse_monitor_message(self._view.recv_multipart(zmq.NOBLOCK))
            except zmq.Again:
                break
            kind, fd = event["event"], event["value"]
            if kind in (zmq.EVENT_ACCEPTED, zmq.EVENT_CONNECTED):
                self._open.add(fd)
            elif kind == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                if self._peer is None:
                    self._peer = set(self._open)
                self.connected = True
            elif kind == zmq.EVENT_DISCONNECTED:
                self._open.discard(fd)
                if self._peer is not None and fd in self._peer:
                    self._peer.discard(fd)
                    self.dropped = not self._peer
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

    def __init__(self, rank: int, node: str, watch: ConnectionWatch,
                 authenticator: ThreadAuthenticator | None = None) -> None:
        self.rank = rank
        self.node = node
        self.pid: int | None = None
        """The engine core's pid on its node, once it is ready."""
        self.returncode: int | None = None
        self.exit_reason: str | None = None
        self._watch = watch
        self._authenticator = authenticator

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
        """Before the data sockets' context is terminated (its open sockets would block that)."""
        self._watch.close()
        if self._authenticator is not None:
            self._authenticator.stop()
            self._authenticator = None


class _Authenticator(ThreadAuthenticator):
    def curve_user_id(self, client_public_key: bytes) -> str:
        """No User-Id: with one, libzmq queues a credential message ahead of the peer's first one,
        which makes a socket poll readable while a receive finds nothing (EAGAIN)."""
        return ""


def _admit_only(context: zmq.Context, client_key: bytes) -> ThreadAuthenticator:
    """The ZAP handler of `context`: CURVE clients with `client_key` only (without a handler, a
    CURVE server admits any client that knows its public key)."""

    class OneKey:
        def callback(self, domain: str, key: bytes) -> bool:
            return same_mac(client_key, key)

    authenticator = _Authenticator(context, log=logging.getLogger(f"{__name__}.zap"))
    authenticator.start()
    authenticator.configure_curve_callback(_ZAP_DOMAIN.decode(), OneKey())
    return authenticator


@dataclass
class _Challenge:
    """A hello the head answered, waiting for the joiner's authenticated answer."""

    rank: Any
    size: Any
    node: str
    client_nonce: bytes
    server_nonce: bytes
    expires: float


@dataclass
class JoinGrant:
    """What a joining engine core got from the head: its data addresses, the CURVE keys of its
    data connections and the shared experts' group (if the replicas share theirs)."""

    input_addr: str
    output_addr: str
    expert_group: str | None
    server_key: bytes
    client_public: bytes
    client_secret: bytes = field(repr=False)


# ---- the head ------------------------------------------------------------------------------------
class RemoteReplicaListener:
    """The head's rendezvous: bound before the local replicas start (so nodes may join while they
    load), it welcomes each expected rank once, after it proved it holds the deployment's secret,
    and closes when all have joined."""

    def __init__(self, args: Any, ranks: range, expert_group: str | None = None) -> None:
        self.args = args
        self.ranks = ranks
        self.expert_group = expert_group
        """The init method of the replicas' shared expert-parallel group, handed to each joiner."""
        self.address = rpc_address(args)
        self.host = args.data_parallel_address or "127.0.0.1"
        self._secret = data_parallel_secret(self.host)
        self._challenges: dict[bytes, _Challenge] = {}
        self.num_refused = 0
        """Joins refused for failing the challenge (no secret, another secret, a stale answer)."""
        self._context = zmq.asyncio.Context()
        self._router = _tcp_socket(self._context, zmq.ROUTER, JOIN_MAX_MESSAGE_BYTES)
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
                frames = await self._recv_join()
                if frames is None:
                    continue
                identity, payload, peer = frames
                joined = self._answer(identity, payload, peer, clients, engine_timeout_s)
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

    async def _recv_join(self) -> tuple[bytes, bytes, str] | None:
        """(identity, payload, the peer's address) of the next join message; None for one of more
        frames than a join has (read one by one, each bounded, and dropped)."""
        frames = [await self._router.recv(copy=False)]
        while frames[-1].more:
            frame = await self._router.recv(copy=False)
            if len(frames) <= JOIN_MAX_FRAMES:
                frames.append(frame)
        peer = _peer_address(frames[-1])
        if len(frames) != JOIN_MAX_FRAMES:
            logger.warning("data-parallel rendezvous %s: ignored a message of %d frames from %s", self.address,
                           len(frames), peer)
            return None
        return frames[0].bytes, frames[1].bytes, peer

    def _answer(self, identity: bytes, payload: bytes, peer: str, joined: dict, engine_timeout_s: float | None):
        """A hello gets a challenge; an answer to it, if it proves the secret, (rank, its client)
        with the data sockets bound; anything else None (refused, logged with the peer's address)."""
        try:
            message = serialization.decode(payload)
        except (ValueError, TypeError) as e:
            logger.warning("data-parallel rendezvous %s: ignored a malformed message from %s (%s)", self.address,
                           peer, e)
            return None
        if message[0] == "hello" and len(message) == 5 and isinstance(message[4], bytes):
            self._challenge(identity, message)
            return None
        challenge = self._challenges.pop(identity, None)
        if (message[0] != "auth" or len(message) != 3 or challenge is None or not isinstance(message[2], bytes)
                or time.monotonic() > challenge.expires
                or not same_mac(join_mac(self._secret, challenge.client_nonce, challenge.server_nonce,
                                         challenge.rank, challenge.size, challenge.node, message[2]), message[1])):
            self.num_refused += 1
            claimed = f" (node {challenge.node!r}, rank {challenge.rank!r})" if challenge is not None else ""
            logger.warning("data-parallel rendezvous %s: refused a join from %s%s: not authenticated with the "
                           "deployment's secret ($%s differs, or is not set on that node)", self.address, peer,
                           claimed, SECRET_ENV)
            self._router.send_multipart([identity, serialization.encode(
                ["refused", f"not authenticated: ${SECRET_ENV} differs from the head's"])])
            return None
        return self._welcome(identity, challenge, message[2], peer, joined, engine_timeout_s)

    def _challenge(self, identity: bytes, hello: list) -> None:
        _, rank, size, node, client_nonce = hello
        now = time.monotonic()
        for key in [k for k, c in self._challenges.items() if c.expires < now]:
            del self._challenges[key]
        while len(self._challenges) >= MAX_PENDING_JOINS:
            del self._challenges[next(iter(self._challenges))]
        server_nonce = new_nonce()
        self._challenges[identity] = _Challenge(rank, size, str(node), client_nonce, server_nonce,
                                                now + JOIN_CHALLENGE_TTL_S)
        self._router.send_multipart([identity, serialization.encode(
            ["challenge", server_nonce, head_proof(self._secret, client_nonce, server_nonce)])])

    def _welcome(self, identity: bytes, challenge: _Challenge, client_key: bytes, peer: str, joined: dict,
                 engine_timeout_s: float | None):
        rank, size, node = challenge.rank, challenge.size, challenge.node
        reason = None
        if size != self.args.data_parallel_size:
            reason = f"data_parallel_size {size} differs from the head's {self.args.data_parallel_size}"
        elif rank not in self.ranks:
            reason = f"rank {rank} is not one this head waits for ({self.ranks.start}..{self.ranks.stop - 1})"
        elif rank in joined:
            reason = f"rank {rank} has already joined"
        if reason is not None:
            logger.error("refused a data-parallel replica from %s (%s): %s", node, peer, reason)
            self._router.send_multipart([identity, serialization.encode(["refused", reason])])
            return None
        context = zmq.asyncio.Context()  # the client's own: its shutdown terminates it
        authenticator = _admit_only(context, client_key)
        server_key, server_secret = zmq.curve_keypair()
        input_socket = _tcp_socket(context, zmq.PUSH)
        input_socket.setsockopt(zmq.SNDHWM, 0)
        output_socket = _tcp_socket(context, zmq.PULL)
        output_socket.setsockopt(zmq.RCVHWM, 0)
        for sock in (input_socket, output_socket):
            sock.curve_server = True
            sock.curve_publickey = server_key
            sock.curve_secretkey = server_secret
            sock.zap_domain = _ZAP_DOMAIN
        watch = ConnectionWatch(output_socket)
        input_socket.bind(f"tcp://{self.host}:*")
        output_socket.bind(f"tcp://{self.host}:*")
        addresses = [input_socket.getsockopt_string(zmq.LAST_ENDPOINT),
                     output_socket.getsockopt_string(zmq.LAST_ENDPOINT)]
        mac = welcome_mac(self._secret, challenge.client_nonce, challenge.server_nonce, *addresses,
                          self.expert_group, server_key)
        self._router.send_multipart([identity, serialization.encode(
            ["welcome", *addresses, self.expert_group, server_key, mac])])
        logger.info("data-parallel engine %d joined from %s (%s)", rank, node, peer)
        client = EngineCoreClient(RemoteEngineProcess(rank, node, watch, authenticator), context, input_socket,
                                  output_socket, [], engine_timeout_s)
        return rank, client

    def close(self) -> None:
        self._router.close(linger=0)
        self._context.term()


def _peer_address(frame: zmq.Frame) -> str:
    try:
        return frame.get("Peer-Address")
    except (zmq.ZMQError, UnicodeDecodeError):
        return "an unknown address"


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
def join_head(address: str, rank: int, data_parallel_size: int, timeout_s: float) -> JoinGrant:
    """An engine core on a headless node: prove to the head (and have it prove) that both hold the
    deployment's secret, and get this rank's data addresses and keys. RuntimeError if refused."""
    secret = data_parallel_secret(address.rsplit(":", 1)[0].removeprefix("tcp://"))
    node = socket.gethostname()
    client_nonce = new_nonce()
    client_public, client_secret = zmq.curve_keypair()
    deadline = time.monotonic() + timeout_s
    dealer = _tcp_socket(zmq.Context.instance(), zmq.DEALER, JOIN_MAX_MESSAGE_BYTES)

    def ask(message: list) -> list:
        dealer.send(serialization.encode(message))
        if not dealer.poll(max(1, int((deadline - time.monotonic()) * 1000))):
            raise RuntimeError(f"no data-parallel head answered at {address} within {timeout_s:.0f} s")
        answer = serialization.decode(dealer.recv())
        if answer[0] == "refused":
            raise RuntimeError(f"the data-parallel head at {address} refused rank {rank}: {answer[1]}")
        return answer

    try:
        dealer.connect(address)
        challenge = ask(["hello", rank, data_parallel_size, node, client_nonce])
        if challenge[0] != "challenge" or not same_mac(head_proof(secret, client_nonce, challenge[1]), challenge[2]):
            raise RuntimeError(f"the data-parallel head at {address} did not prove it holds the deployment's secret "
                               f"(${SECRET_ENV} differs between the nodes)")
        server_nonce = challenge[1]
        welcome = ask(["auth", join_mac(secret, client_nonce, server_nonce, rank, data_parallel_size, node,
                                        client_public), client_public])
    finally:
        dealer.close(linger=0)
    if welcome[0] != "welcome" or len(welcome) != 6:
        raise RuntimeError(f"the data-parallel head at {address} answered the join with {welcome[0]!r}")
    _, input_addr, output_addr, expert_group, server_key, mac = welcome
    if not same_mac(welcome_mac(secret, client_nonce, server_nonce, input_addr, output_addr, expert_group,
                                server_key), mac):
        raise RuntimeError(f"the welcome from {address} is not signed with the deployment's secret")
    return JoinGrant(input_addr, output_addr, expert_group, server_key, client_public, client_secret)


def connect_data_sockets(context: zmq.Context, grant: JoinGrant):
    """The joining core's PULL (requests) and PUSH (outputs), CURVE clients of the head's sockets
    for this rank, with a watch that tells when the head has gone (then the core exits)."""
    input_socket = _tcp_socket(context, zmq.PULL)
    input_socket.setsockopt(zmq.RCVHWM, 0)
    output_socket = _tcp_socket(context, zmq.PUSH)
    output_socket.setsockopt(zmq.SNDHWM, 0)
    output_socket.setsockopt(zmq.LINGER, 2000)
    for sock in (input_socket, output_socket):
        sock.curve_serverkey = grant.server_key
        sock.curve_publickey = grant.client_public
        sock.curve_secretkey = grant.client_secret
    watch = ConnectionWatch(input_socket)
    input_socket.connect(grant.input_addr)
    output_socket.connect(grant.output_addr)
    return input_socket, output_socket, watch


# ---- the headless node ------------------------------------------------------------------------------
def run_headless(engine_args: Any, startup_timeout_s: float = 600.0) -> int:
    """`kvtide serve MODEL --headless ...`: start this node's replicas, each joining the head; exit
    when all have exited (the head shut them down or went away). SIGINT/SIGTERM stop them."""
    local = engine_args.data_parallel_size_local
    start = engine_args.data_parallel_start_rank
    placements = place_local_replicas(engine_args, local)
    replica_args = engine_args.replace(data_parallel_size=1, data_parallel_size_local=None, data_parallel_start_rank=0,
                                       data_parallel_address=None, data_parallel_rpc_port=None)
    replica_fields = asdict(replica_args)
    address = rpc_address(engine_args)
    procs: list[subprocess.Popen] = []
    for p in placements:
        rank = start + p.rank
        command = [sys.executable, "-m", "kvtide.engine.core_proc", "--handshake", address,
                   "--data-parallel-size", str(engine_args.data_parallel_size), "--handshake-timeout",
                   str(startup_timeout_s), "--parent-pid", str(os.getpid()),
                   # A file the replica reads and deletes: the args may hold secrets, argv is public.
                   "--engine-args-file", write_args_file(replica_fields, prefix="kvtide-engine-args-"),
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
