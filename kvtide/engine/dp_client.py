"""DPEngineCoreClient: N engine-core replicas (data parallelism) behind the one client interface
AsyncLLM uses.

    API process                                              engine-core processes
    ┌─────────────────────────────┐   ipc (ZMQ, msgpack)   ┌───────────────────────────┐
    │ AsyncLLM                    │ ─────────────────────▶ │ replica 0: EngineCore     │
    │   DPEngineCoreClient        │ ◀───────────────────── │   (scheduler, KV, model)  │
    │     DPLoadBalancer          │ ─────────────────────▶ │ replica 1: EngineCore     │
    │     EngineCoreClient x N    │ ◀───────────────────── │   ...                     │
    └─────────────────────────────┘                        └───────────────────────────┘

Each replica is a plain engine (its own EngineCoreClient, process, watchdog), started with
data_parallel_size=1; with --enable-expert-parallel the replicas' MoE layers form one
expert-parallel group and the replicas step in lockstep (core_proc.py). With
--data-parallel-size-local < --data-parallel-size the ranks after this node's join from headless
nodes over TCP (dp_remote.py) and are driven the same way. The balancer (dp_balancer.py) picks a
replica per user request: all its engine-core requests (n > 1 children) go there, and aborts and
stops follow them. One reader task per replica merges the outputs into one stream. Utility calls
are broadcast and their answers combined (stats summed). If any replica dies, the whole engine is
dead: the same EngineDeadError, /health 503 and failed requests as a single engine's death.

On CPU each replica is pinned to an even share of the usable cores and runs that many torch
threads; on CUDA each gets its own GPUs (CUDA_VISIBLE_DEVICES). Replicas synchronize their steps
only when they share experts (dummy batches on idle replicas, as vLLM's DP + EP).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from collections.abc import Callable, Sequence
from typing import Any

from kvtide.engine.core_client import (
    AddErrorMessage,
    EngineCoreClient,
    EngineCoreInfo,
    EngineDeadError,
    OutputsMessage,
)
from kvtide.engine.dp_auth import data_parallel_secret
from kvtide.engine.dp_balancer import DEFAULT_LOAD_THRESHOLD, DPLoadBalancer
from kvtide.engine.dp_placement import place_local_replicas
from kvtide.engine.messages import SchedulerStats
from kvtide.engine.request import EngineCoreRequest

logger = logging.getLogger(__name__)

_DEAD = object()
"""Put in the merged output queue when the engine dies, to wake get_output."""


def check_data_parallel_args(args: Any, headless: bool = False) -> None:
    """The data-parallel flags, checked before any model loads (so `kvtide serve` refuses at once).
    A node runs replicas start_rank .. start_rank + size_local - 1 of data_parallel_size: the head
    (the API server's node) starts at 0, a headless node after the head's and earlier nodes'."""
    dp = args.data_parallel_size
    if not isinstance(dp, int) or dp < 1:
        raise ValueError(f"data_parallel_size must be an integer >= 1, got {dp!r}")
    local = args.data_parallel_size_local
    if local is not None and (not isinstance(local, int) or not 1 <= local <= dp):
        raise ValueError(f"data_parallel_size_local must be in [1, data_parallel_size={dp}], got {local!r}")
    start = args.data_parallel_start_rank
    if not isinstance(start, int) or not 0 <= start < dp:
        raise ValueError(f"data_parallel_start_rank must be in [0, data_parallel_size={dp}), got {start!r}")
    if start + (local if local is not None else dp) > dp:
        raise ValueError(f"data_parallel_start_rank={start} + data_parallel_size_local={local if local else dp} "
                         f"exceeds data_parallel_size={dp}")
    port = args.data_parallel_rpc_port
    if port is not None and (not isinstance(port, int) or not 0 < port < 65536):
        raise ValueError(f"data_parallel_rpc_port must be a TCP port in [1, 65535], got {port!r}")
    if headless:
        if local is None or start == 0:
            raise ValueError("--headless runs some of another node's data-parallel replicas: give "
                             "--data-parallel-size-local (replicas on this node) and --data-parallel-start-rank "
                             "(>= 1; ranks 0 .. are the head's, which serves the API) and the head's "
                             "--data-parallel-address / --data-parallel-rpc-port")
        if not args.data_parallel_address:
            raise ValueError("--headless needs --data-parallel-address: the head node's address to join")
    elif start != 0:
        raise ValueError(f"data_parallel_start_rank={start} is for a headless node (--headless); the node "
                         f"that serves the API runs ranks 0 ..")
    if headless or (local is not None and local < dp):  # ranks join over TCP: only with the secret
        data_parallel_secret(args.data_parallel_address or "127.0.0.1")


def _expert_group_address(args: Any) -> str | None:
    """With --enable-expert-parallel the replicas share their experts (vLLM's DP + EP): the
    torch.distributed rendezvous of their group, on this node (the head) at a free port."""
    if not args.enable_expert_parallel or args.data_parallel_size == 1:
        return None
    import socket

    host = args.data_parallel_address or "127.0.0.1"
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return f"tcp://{host}:{sock.getsockname()[1]}"


def merge_stats(stats: Sequence[SchedulerStats]) -> SchedulerStats:
    """One engine's view of N replicas: counts summed, KV usage over all blocks. Per-replica
    series (structured-output compile times, numbered per replica) keep replica 0's."""
    if len(stats) == 1:
        return stats[0]
    total = SchedulerStats()
    for name in ("num_running", "num_waiting", "num_preemptions", "prefix_cache_queries", "prefix_cache_hits",
                 "num_used_blocks", "num_evictable_blocks", "num_blocks", "max_num_seqs", "max_num_batched_tokens"):
        setattr(total, name, sum(getattr(s, name) for s in stats))
    total.kv_cache_usage = total.num_used_blocks / total.num_blocks if total.num_blocks else \
        sum(s.kv_cache_usage for s in stats) / len(stats)
    total.iteration_tokens = _sum_nested([s.iteration_tokens for s in stats])
    for name in ("spec_decoding", "expert_load", "structured_output", "kv_connector", "memory"):
        present = [getattr(s, name) for s in stats if getattr(s, name) is not None]
        setattr(total, name, _sum_nested(present) if present else None)
    if total.structured_output is not None:
        first = next(s.structured_output for s in stats if s.structured_output is not None)
        total.structured_output["compile_seconds"] = first.get("compile_seconds", [])
    return total


def _sum_nested(values: list[Any]) -> Any:
    """Sum numbers, and lists / dicts of them element-wise; anything else is taken from the first."""
    first = values[0]
    if isinstance(first, bool) or not isinstance(first, (int, float, list, dict)):
        return first
    if isinstance(first, (int, float)):
        return sum(v for v in values if isinstance(v, (int, float)))
    if isinstance(first, list):
        if any(not isinstance(v, list) or len(v) != len(first) for v in values):
            return first
        return [_sum_nested([v[i] for v in values]) for i in range(len(first))]
    keys = dict.fromkeys(k for v in values if isinstance(v, dict) for k in v)  # every replica's, in order
    return {k: _sum_nested([v[k] for v in values if isinstance(v, dict) and k in v]) for k in keys}


class DPEngineCoreClient:
    """N EngineCoreClients behind EngineCoreClient's interface, balanced by DPLoadBalancer."""

    def __init__(self, clients: list[EngineCoreClient], balancer: DPLoadBalancer) -> None:
        assert clients and all(c.info is not None for c in clients)
        self.clients = clients
        self.balancer = balancer
        first = clients[0].info
        assert first is not None
        self.info: EngineCoreInfo = dataclasses.replace(first, num_blocks=sum(c.info.num_blocks for c in clients))
        self.dead_error: EngineDeadError | None = None
        self._dead_listeners: list[Callable[[EngineDeadError], None]] = []
        self._outputs: asyncio.Queue = asyncio.Queue()
        self._closed = False
        for rank, client in enumerate(clients):
            client.add_dead_listener(lambda error, rank=rank: self.mark_dead(f"data-parallel engine {rank}: {error}"))
        loop = asyncio.get_running_loop()
        self._readers = [loop.create_task(self._read(rank, c)) for rank, c in enumerate(clients)]

    @property
    def num_engines(self) -> int:
        return len(self.clients)

    @property
    def pids(self) -> list[int]:
        return [c.proc.pid for c in self.clients]

    # ---- start / stop ------------------------------------------------------------------------
    @classmethod
    async def start(cls, engine_args: Any, startup_timeout_s: float = 600.0,
                    engine_timeout_s: float | None = None,
                    load_threshold: int = DEFAULT_LOAD_THRESHOLD) -> DPEngineCoreClient:
        """Start data_parallel_size replicas of `engine_args` at once; wait until all are ready."""
        check_data_parallel_args(engine_args)
        num = engine_args.data_parallel_size
        local = engine_args.data_parallel_size_local or num
        placements = place_local_replicas(engine_args, local)
        replica_args = engine_args.replace(data_parallel_size=1, data_parallel_size_local=None,
                                           data_parallel_address=None, data_parallel_rpc_port=None)
        for p in placements:
            logger.info("data-parallel engine %d: %s", p.rank,
                        p.env.get("CUDA_VISIBLE_DEVICES") and f"GPUs {p.env['CUDA_VISIBLE_DEVICES']}"
                        or f"CPUs {p.cpu_affinity or 'all'}, {p.cpu_threads or 'default'} torch threads")
        expert_group = _expert_group_address(engine_args)
        listener = None
        if local < num:  # the other ranks join from their nodes (dp_remote.py); bound before any loads
            from kvtide.engine.dp_remote import RemoteReplicaListener

            listener = RemoteReplicaListener(engine_args, range(local, num), expert_group)
        starts = [EngineCoreClient.start(replica_args, startup_timeout_s, engine_timeout_s, dp_rank=p.rank,
                                         cpu_threads=p.cpu_threads, cpu_affinity=p.cpu_affinity, env=p.env,
                                         expert_group=(expert_group, num) if expert_group else None)
                  for p in placements]
        if listener is not None:
            starts.append(listener.accept(startup_timeout_s, engine_timeout_s))
        results = await asyncio.gather(*starts, return_exceptions=True)
        if listener is not None and isinstance(results[-1], list):
            results = results[:-1] + results[-1]
        clients = [r for r in results if isinstance(r, EngineCoreClient)]
        errors = [r for r in results if isinstance(r, BaseException)]
        if not errors and local < num:
            from kvtide.engine.dp_remote import check_same_model

            try:
                check_same_model(clients)
            except ValueError as e:
                errors.append(e)
        if errors:
            for client in clients:
                client.request_shutdown()
            for client in clients:
                client.shutdown(timeout_s=2.0)
            first = errors[0]
            rank = results.index(first) if first in results else local
            if isinstance(first, ValueError) or rank >= local:  # the listener's errors name their ranks
                raise first
            raise RuntimeError(f"data-parallel engine {rank}: {first}") from first
        balancer = DPLoadBalancer(num, block_size=clients[0].info.block_size,
                                  enable_prefix_affinity=engine_args.enable_prefix_caching,
                                  load_threshold=load_threshold,
                                  max_blocks_per_engine=[max(1, c.info.num_blocks) for c in clients])
        return cls(clients, balancer)

    def shutdown(self, timeout_s: float = 5.0) -> None:
        """Stop every replica (all are asked first, so they exit together). Idempotent."""
        if self._closed:
            return
        self._closed = True
        for task in self._readers:
            task.cancel()
        for client in self.clients:
            client.request_shutdown()
        for client in self.clients:
            client.shutdown(timeout_s)

    # ---- liveness ----------------------------------------------------------------------------
    @property
    def is_dead(self) -> bool:
        return self.dead_error is not None

    def add_dead_listener(self, listener: Callable[[EngineDeadError], None]) -> None:
        self._dead_listeners.append(listener)

    def mark_dead(self, reason: str) -> None:
        if self.dead_error is not None or self._closed:
            return
        logger.error("data-parallel engine is dead: %s", reason)
        self.dead_error = EngineDeadError(reason)
        self._outputs.put_nowait(_DEAD)
        for listener in self._dead_listeners:
            listener(self.dead_error)

    def _check_alive(self) -> None:
        if self.dead_error is not None:
            raise self.dead_error
        if self._closed:
            raise EngineDeadError("engine core shut down")

    # ---- sending -----------------------------------------------------------------------------
    def add_requests(self, requests: list[EngineCoreRequest]) -> None:
        """One user request's engine-core requests (all n children): to one replica."""
        self._check_alive()
        if not requests:
            return
        ids = [r.request_id for r in requests]
        first = requests[0]
        rank = self.balancer.route(ids, first.prompt_token_ids, first.sampling_params.cache_salt)
        try:
            self.clients[rank].add_requests(requests)
        except BaseException:
            self.balancer.finish(ids)
            raise

    def abort_requests(self, request_ids: list[str]) -> None:
        groups = self.balancer.group_by_engine(request_ids)
        self.balancer.finish(request_ids)
        for rank, ids in groups.items():
            self.clients[rank].abort_requests(ids)

    def stop_requests(self, request_ids: list[str]) -> None:
        groups = self.balancer.group_by_engine(request_ids)
        self.balancer.finish(request_ids)
        for rank, ids in groups.items():
            self.clients[rank].stop_requests(ids)

    async def call_utility_each(self, method: str, *args: Any, timeout_s: float | None = None) -> list[Any]:
        """Run `method` in every replica; their answers in rank order."""
        self._check_alive()
        return list(await asyncio.gather(*(c.call_utility(method, *args, timeout_s=timeout_s)
                                           for c in self.clients)))

    async def call_utility(self, method: str, *args: Any, timeout_s: float | None = None) -> Any:
        """Broadcast `method` and combine the answers as one engine would give them."""
        results = await self.call_utility_each(method, *args, timeout_s=timeout_s)
        if method == "get_stats":
            from kvtide.engine.serialization import stats_from_wire

            return dataclasses.asdict(merge_stats([stats_from_wire(r) for r in results]))
        if method == "reset_prefix_cache":
            for rank, reset in enumerate(results):
                if reset:
                    self.balancer.forget_prefixes(rank)
            return all(results)
        if method in ("sleep", "update_weights_from_disk"):  # the replicas' prefix caches are reset
            for rank in range(len(results)):
                self.balancer.forget_prefixes(rank)
            return max(results)
        if method in ("wake_up", "sleep_level"):
            return max(results)
        if method == "num_steps":
            return sum(results)
        if method in ("ping", "check_integrity"):
            return results[0]
        return results

    # ---- receiving ---------------------------------------------------------------------------
    async def _read(self, rank: int, client: EngineCoreClient) -> None:
        try:
            while True:
                self._outputs.put_nowait((rank, await client.get_output()))
        except EngineDeadError:
            pass  # its dead listener marked the whole engine dead
        except asyncio.CancelledError:
            raise
        except Exception as e:
            logger.exception("reader of data-parallel engine %d failed", rank)
            self.mark_dead(f"data-parallel engine {rank}: reader failed: {type(e).__name__}: {e}")

    async def get_output(self) -> OutputsMessage | AddErrorMessage:
        """The next message of any replica; EngineDeadError once any replica is dead."""
        self._check_alive()
        item = await self._outputs.get()
        if item is _DEAD:
            self._outputs.put_nowait(_DEAD)  # for any other waiter
            self._check_alive()
        _, message = item
        if isinstance(message, OutputsMessage):
            self.balancer.mark_scheduled(message.scheduled_at)
            done = [o.request_id for o in message.outputs if o.finished or o.error is not None]
            if done:
                self.balancer.finish(done)
        elif isinstance(message, AddErrorMessage):
            self.balancer.finish(message.request_ids)
        return message

    # ---- introspection -----------------------------------------------------------------------
    def engine_summaries(self) -> list[dict[str, Any]]:
        """Per replica: pid, requests held and routed (for /internal/stats and /metrics)."""
        return [{"engine": rank, "pid": client.proc.pid, "num_requests": self.balancer.held[rank],
                 "num_waiting": self.balancer.waiting[rank], "load": self.balancer.loads[rank],
                 **dataclasses.asdict(self.balancer.counters[rank]),
                 "prefix_index_blocks": len(self.balancer.indexes[rank])}
                for rank, client in enumerate(self.clients)]
