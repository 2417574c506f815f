"""EngineCoreClient: the API process's handle on the engine-core process.

    API process                                         engine-core process
    ┌──────────────────────┐  PUSH ──ipc://…-input──▶ PULL ┌───────────────────────┐
    │ AsyncLLM             │                                │ EngineCoreProc.run()  │
    │   EngineCoreClient   │  PULL ◀─ipc://…-output── PUSH  │   EngineCore.step()   │
    └──────────────────────┘                                └───────────────────────┘
          ▲ monitor task: proc.poll() every 0.2 s -> EngineDeadError for everyone waiting
          ▲ watchdog (same task): nothing heard for engine_timeout_s -> EngineDeadError too

The client spawns the process (a fresh interpreter: `python -m kvtide.engine.core_proc`), binds
both sockets (ipc paths in a new 0700 directory that only this user can enter, removed at
shutdown), waits for "ready", then sends requests
and receives outputs as msgspec msgpack (serialization.py). Utility calls (stats, prefix-cache
reset, integrity check) are request/response pairs matched by a call id. With data parallelism,
DPEngineCoreClient (dp_client.py) holds one of these per replica.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import os
import subprocess
import sys
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import zmq
import zmq.asyncio

from kvtide.engine import serialization
from kvtide.engine.messages import EngineCoreOutput
from kvtide.engine.request import EngineCoreRequest
from kvtide.private_files import private_dir, remove_private_dir, write_args_file

logger = logging.getLogger(__name__)

MONITOR_INTERVAL_S = 0.2
"""How often the client checks that the engine-core process is alive."""
STALL_GRACE_S = 1.0
"""A monitor tick later than this beyond its interval: this process stalled (see _monitor)."""
DEFAULT_ENGINE_TIMEOUT_S = 30.0
"""The watchdog's default: an engine core silent this long (no output, no answer to its pings) is
declared dead. It must exceed the longest single step (a long prefill on a CPU, a first step that
JIT-compiles kernels); a stopped (SIGSTOP) or wedged process is what it is for."""
_HEARTBEAT_CALL_ID = -1
"""Call id of the watchdog's pings; their answers only refresh the time last heard."""


class EngineDeadError(RuntimeError):
    """The engine-core process died or stopped answering; every request in flight has failed."""


class EngineGenerateError(RuntimeError):
    """One request failed inside the engine (the engine itself is fine). `status`: the HTTP status
    when the request itself was at fault (a grammar that does not compile: 400, or too slowly: 408)."""

    def __init__(self, message: str, status: int | None = None) -> None:
        super().__init__(message)
        self.status = status


class EngineQueueFullError(RuntimeError):
    """The engine's waiting queue is full (--max-waiting-requests); try again later."""


@dataclass
class EngineCoreInfo:
    """What the engine core reports once ready."""

    model_dir: str
    tokenizer_dir: str
    vocab_size: int
    max_model_len: int
    eos_token_ids: list[int]
    num_blocks: int
    block_size: int
    pid: int
    architecture: str = ""
    """The architecture the model runs as, and the implementation running it (kvtide or transformers)."""
    model_impl: str = ""
    pooler: dict | None = None
    """A pooling model's PoolerConfig fields and hidden_size (kvtide/pooling/config.py); None: generation."""


@dataclass
class OutputsMessage:
    outputs: list[EngineCoreOutput]
    scheduled_at: dict[str, float]
    """Requests first scheduled in this step -> the step's start time (for queue time)."""


@dataclass
class AddErrorMessage:
    request_ids: list[str]
    kind: str
    """'invalid' or 'queue_full'."""
    message: str


@dataclass
class SpawnedEngineCore:
    """An engine-core process started before its client's sockets exist: `kvtide serve` starts it
    before importing its web stack, so the two processes' imports run side by side. The process's
    connects wait for EngineCoreClient.start to bind the sockets."""

    proc: subprocess.Popen
    ipc_paths: tuple[str, str]
    """(input, output) socket paths, in a private directory of their own (_new_ipc_paths)."""

    def kill(self) -> None:
        """Stop the process when its client will never be made (a later start-up step failed)."""
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()
        remove_private_dir(os.path.dirname(self.ipc_paths[0]))


def _new_ipc_paths() -> tuple[str, str]:
    """Socket paths in a new 0700 directory: in a shared /tmp, predictable names would let another
    local user connect to the engine (and read prompts) or take a name first."""
    directory = private_dir("kvtide-engine-")
    return os.path.join(directory, "input.sock"), os.path.join(directory, "output.sock")


def spawn_engine_core(engine_args: Any, *, dp_rank: int | None = None, cpu_threads: int | None = None,
                      cpu_affinity: Sequence[int] | None = None, env: dict[str, str] | None = None,
                      expert_group: tuple[str, int] | None = None,
                      ipc_paths: tuple[str, str] | None = None) -> SpawnedEngineCore:
    """Start `python -m kvtide.engine.core_proc` for `engine_args`; EngineCoreClient.start binds the
    sockets it connects to (see there for the other arguments). The engine args (which may hold
    secrets: a kv_secret, a Redis password) travel in a 0600 file next to the sockets that the
    child reads and deletes, never on its command line."""
    input_path, output_path = ipc_paths or _new_ipc_paths()
    args_path = write_args_file(asdict(engine_args), os.path.dirname(input_path), prefix="engine-args-")
    command = [sys.executable, "-m", "kvtide.engine.core_proc", "--input", f"ipc://{input_path}",
               "--output", f"ipc://{output_path}", "--parent-pid", str(os.getpid()),
               "--engine-args-file", args_path]
    if dp_rank is not None:
        command += ["--dp-rank", str(dp_rank)]
    if cpu_threads is not None:
        command += ["--cpu-threads", str(cpu_threads)]
    if cpu_affinity:
        command += ["--cpu-affinity", ",".join(str(c) for c in cpu_affinity)]
    if expert_group is not None:
        command += ["--expert-group", expert_group[0], "--data-parallel-size", str(expert_group[1])]
    try:
        proc = subprocess.Popen(command, stdin=subprocess.DEVNULL, env={**os.environ, **env} if env else None)
    except BaseException:
        remove_private_dir(os.path.dirname(input_path))
        raise
    return SpawnedEngineCore(proc, (input_path, output_path))


class EngineCoreClient:
    def __init__(self, proc: subprocess.Popen, context: zmq.asyncio.Context, input_socket: zmq.asyncio.Socket,
                 output_socket: zmq.asyncio.Socket, ipc_paths: list[str],
                 engine_timeout_s: float | None = None) -> None:
        self.proc = proc
        self.engine_timeout_s = engine_timeout_s or None
        """Watchdog: silent this long -> dead (None or 0: only a process exit counts)."""
        self._last_heard = 0.0
        self._last_ping = 0.0
        self._unresponsive = False
        self._context = context
        self._input = input_socket
        self._output = output_socket
        self._ipc_paths = ipc_paths
        self._call_ids = itertools.count()
        self._pending_calls: dict[int, asyncio.Future] = {}
        self._dead_listeners: list[Callable[[EngineDeadError], None]] = []
        self.dead_error: EngineDeadError | None = None
        self.info: EngineCoreInfo | None = None
        self._monitor_task: asyncio.Task | None = None
        self._closed = False
        self._shutdown_sent = False

    # ---- start / stop ------------------------------------------------------------------------
    @classmethod
    async def start(cls, engine_args: Any, startup_timeout_s: float = 600.0,
                    engine_timeout_s: float | None = None, *, dp_rank: int | None = None,
                    cpu_threads: int | None = None, cpu_affinity: Sequence[int] | None = None,
                    env: dict[str, str] | None = None,
                    expert_group: tuple[str, int] | None = None,
                    spawned: SpawnedEngineCore | None = None) -> EngineCoreClient:
        """Spawn the engine-core process for `engine_args` (an EngineArgs) and wait until ready;
        or, given `spawned` (spawn_engine_core, called earlier), only bind its sockets and wait.
        A data-parallel replica also gets its rank (for its log lines), its CPU share (cores and
        torch threads), extra environment (CUDA_VISIBLE_DEVICES) and, when the replicas share their
        experts, that group's (init method, size)."""
        context = zmq.asyncio.Context()
        paths = spawned.ipc_paths if spawned is not None else _new_ipc_paths()
        try:
            input_socket = context.socket(zmq.PUSH)
            input_socket.setsockopt(zmq.LINGER, 0)
            # No high-water marks: a send must never fail or block (the engine bounds its own queue).
            input_socket.setsockopt(zmq.SNDHWM, 0)
            input_socket.bind(f"ipc://{paths[0]}")
            output_socket = context.socket(zmq.PULL)
            output_socket.setsockopt(zmq.LINGER, 0)
            output_socket.setsockopt(zmq.RCVHWM, 0)
            output_socket.bind(f"ipc://{paths[1]}")
            if spawned is None:
                spawned = spawn_engine_core(engine_args, dp_rank=dp_rank, cpu_threads=cpu_threads,
                                            cpu_affinity=cpu_affinity, env=env, expert_group=expert_group,
                                            ipc_paths=paths)
        except BaseException:
            context.destroy(linger=0)
            if spawned is not None:
                spawned.kill()
            else:
                remove_private_dir(os.path.dirname(paths[0]))
            raise
        client = cls(spawned.proc, context, input_socket, output_socket, list(paths), engine_timeout_s)
        await client.wait_ready(startup_timeout_s)
        return client

    async def wait_ready(self, timeout_s: float) -> None:
        """Wait for the engine core's "ready", then watch it (process exit, watchdog). If it fails
        to start, everything is released and the error raised."""
        try:
            await self._wait_ready(timeout_s)
        except BaseException:
            self.shutdown(timeout_s=2.0)
            raise
        self._monitor_task = asyncio.get_running_loop().create_task(self._monitor())

    async def _wait_ready(self, timeout_s: float) -> None:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while True:
            if await self._output.poll(timeout=200):
                message = serialization.decode(await self._output.recv())
                if message[0] == "ready":
                    self.info = EngineCoreInfo(**message[1])
                    self._last_heard = loop.time()
                    logger.info("engine core ready (pid %d, %d KV blocks of %d tokens)", self.info.pid,
                                self.info.num_blocks, self.info.block_size)
                    return
                if message[0] == "startup_error":
                    raise ValueError(f"engine core failed to start: {message[1]}")
                continue
            if self.proc.poll() is not None:
                raise RuntimeError(f"engine core exited with code {self.proc.returncode} during startup")
            if loop.time() > deadline:
                raise RuntimeError(f"engine core not ready after {timeout_s:.0f} s")

    def shutdown(self, timeout_s: float = 5.0) -> None:
        """Stop the engine-core process (politely, then by force) and release sockets. Idempotent."""
        if self._closed:
            return
        self._closed = True
        if self._monitor_task is not None:
            self._monitor_task.cancel()
        if self.proc.poll() is None and self._unresponsive:
            self.proc.kill()  # stopped or wedged: it would not hear a polite request
            self.proc.wait()
        if self.proc.poll() is None:
            self._send_shutdown()
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.terminate()
                try:
                    self.proc.wait(2.0)
                except subprocess.TimeoutExpired:
                    self.proc.kill()
                    self.proc.wait()
        self._fail_pending_calls(EngineDeadError("engine core shut down"))
        if hasattr(self.proc, "close"):  # a remote engine's connection monitor (dp_remote.py)
            self.proc.close()
        self._input.close(linger=0)
        self._output.close(linger=0)
        self._context.term()
        if self._ipc_paths:  # a remote engine's (tcp) has none
            remove_private_dir(os.path.dirname(self._ipc_paths[0]))

    def request_shutdown(self) -> None:
        """Ask the engine core to exit without waiting (shutdown() then waits): several replicas
        stop together instead of one after the other."""
        if not self._closed and not self._unresponsive and self.proc.poll() is None:
            self._send_shutdown()

    def _send_shutdown(self) -> None:
        if self._shutdown_sent:
            return
        self._shutdown_sent = True
        with contextlib.suppress(zmq.ZMQError):
            sent = self._input.send(serialization.encode(["shutdown"]), flags=zmq.NOBLOCK)
            if isinstance(sent, asyncio.Future):  # zmq.asyncio reports a full queue in the future
                sent.add_done_callback(lambda f: f.cancelled() or f.exception())

    # ---- liveness ----------------------------------------------------------------------------
    @property
    def is_dead(self) -> bool:
        return self.dead_error is not None

    num_engines = 1
    """Engine-core replicas behind this client (DPEngineCoreClient: data_parallel_size)."""

    @property
    def pids(self) -> list[int]:
        return [self.proc.pid]

    def add_dead_listener(self, listener: Callable[[EngineDeadError], None]) -> None:
        self._dead_listeners.append(listener)

    async def _monitor(self) -> None:
        loop = asyncio.get_running_loop()
        last_tick = loop.time()
        while self.proc.poll() is None:
            await asyncio.sleep(MONITOR_INTERVAL_S)
            now = loop.time()
            # A tick that came late means this process was not running (a CPU hog, a blocked event
            # loop, a suspended laptop): the engine could not be heard then, so that time is not
            # counted as its silence; only the time this process was awake to listen is.
            late = now - last_tick - MONITOR_INTERVAL_S
            if late > STALL_GRACE_S:
                self._last_heard += late
            last_tick = now
            if self.engine_timeout_s is not None and self._watchdog(now):
                return
        self.mark_dead(getattr(self.proc, "exit_reason", None)
                       or f"engine core process exited with code {self.proc.returncode}")

    def _watchdog(self, now: float) -> bool:
        """Ping an engine core that has been quiet; declare it dead (True) once it has been silent
        for engine_timeout_s. Messages waiting unread in the socket count as heard: a busy event
        loop in this process is not the engine's fault."""
        assert self.engine_timeout_s is not None
        if self.dead_error is not None or self._closed:
            return True
        if self._output.getsockopt(zmq.EVENTS) & zmq.POLLIN:
            self._last_heard = now
        silent = now - self._last_heard
        if silent > self.engine_timeout_s:
            self._unresponsive = True
            self.mark_dead(f"engine core (pid {self.proc.pid}) unresponsive for {silent:.1f} s "
                           f"(--engine-timeout {self.engine_timeout_s:g})")
            return True
        interval = min(1.0, self.engine_timeout_s / 4)
        if silent > interval and now - self._last_ping > interval:
            self._last_ping = now
            with contextlib.suppress(zmq.ZMQError):
                self._send(["utility", _HEARTBEAT_CALL_ID, "ping", []])
        return False

    def mark_dead(self, reason: str) -> None:
        if self.dead_error is not None or self._closed:
            return
        logger.error("engine core is dead: %s", reason)
        self.dead_error = EngineDeadError(reason)
        self._fail_pending_calls(self.dead_error)
        for listener in self._dead_listeners:
            listener(self.dead_error)

    def _check_alive(self) -> None:
        if self.dead_error is not None:
            raise self.dead_error
        if self._closed:
            raise EngineDeadError("engine core shut down")

    def _fail_pending_calls(self, error: Exception) -> None:
        for future in self._pending_calls.values():
            if not future.done():
                future.set_exception(error)
        self._pending_calls.clear()

    # ---- sending -----------------------------------------------------------------------------
    def _send(self, message: list[Any]) -> None:
        self._check_alive()
        # PUSH to a connected peer queues in memory (default HWM 1000 messages); never blocks.
        self._input.send(serialization.encode(message), flags=zmq.NOBLOCK)

    def add_requests(self, requests: list[EngineCoreRequest]) -> None:
        self._send(["add", [serialization.request_to_wire(r) for r in requests]])

    def abort_requests(self, request_ids: list[str]) -> None:
        if request_ids and not self.is_dead and not self._closed:
            self._send(["abort", request_ids])

    def stop_requests(self, request_ids: list[str]) -> None:
        if request_ids and not self.is_dead and not self._closed:
            self._send(["stop", request_ids])

    async def call_utility(self, method: str, *args: Any, timeout_s: float | None = None) -> Any:
        """Run `method` in the engine core between steps; EngineDeadError if it dies meanwhile."""
        self._check_alive()
        call_id = next(self._call_ids)
        future: asyncio.Future = asyncio.get_running_loop().create_future()
        self._pending_calls[call_id] = future
        try:
            self._send(["utility", call_id, method, list(args)])
            return await asyncio.wait_for(future, timeout_s)
        finally:
            self._pending_calls.pop(call_id, None)

    async def call_utility_each(self, method: str, *args: Any, timeout_s: float | None = None) -> list[Any]:
        """call_utility as a list of one answer per engine core (DPEngineCoreClient has several)."""
        return [await self.call_utility(method, *args, timeout_s=timeout_s)]

    # ---- receiving ---------------------------------------------------------------------------
    async def get_output(self) -> OutputsMessage | AddErrorMessage:
        """The next outputs or add-error message (utility results are routed to their callers).
        Raises EngineDeadError once the engine is dead."""
        while True:
            self._check_alive()
            if not await self._output.poll(timeout=int(MONITOR_INTERVAL_S * 1000)):
                continue
            message = serialization.decode(await self._output.recv())
            self._last_heard = asyncio.get_running_loop().time()
            kind = message[0]
            if kind == "outputs":
                return OutputsMessage([serialization.output_from_wire(o) for o in message[1]], message[2])
            if kind == "add_error":
                return AddErrorMessage([str(r) for r in message[1]], message[2], message[3])
            if kind == "utility_result":
                self._resolve_call(message[1], message[2], message[3])
            elif kind == "fatal":
                # The traceback goes to the log, not into every client's error message.
                logger.error("engine core failed: %s", message[1])
                first_line = str(message[1]).strip().splitlines()[0] if str(message[1]).strip() else "?"
                self.mark_dead(f"engine core failed: {first_line}")
            else:
                logger.error("unexpected engine message %r ignored", kind)

    def _resolve_call(self, call_id: int, ok: bool, result: Any) -> None:
        future = self._pending_calls.pop(call_id, None)
        if future is None or future.done():
            return
        if ok:
            future.set_result(result)
        else:
            future.set_exception(EngineGenerateError(str(result)))
