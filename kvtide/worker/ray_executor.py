"""The Ray executor: a replica's ranks 1.. as Ray actors, so a replica can span nodes. Rank 0 runs in
the engine core's own process and the step logic is the distributed executor's
(distributed_executor.py); this module only places the actors and moves the bytes. Each actor
wraps a `Worker` and speaks worker.py's messages as msgpack bytes (Ray carries the bytes; no
pickled object of ours crosses), one actor call per message, its result the reply.

The replica gets a placement group of world_size bundles ({"CPU": threads_per_rank} on CPU,
{"GPU": 1} on CUDA), rank r on bundle r; bundle 0 is pinned to the driver's node and reserves rank
0's share there. A running cluster is joined (RAY_ADDRESS, or the one `ray start` left on this
node); otherwise a small local one is started, and shut down again with the executor.

A dead actor is noticed at once: each actor runs a `watch` call that only returns when it dies,
and the executor's monitor thread waits on those.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import tempfile
import threading
import time
import traceback
import uuid
from collections.abc import Callable
from typing import Any

try:
    import ray
    from ray.util.placement_group import PlacementGroup, placement_group, remove_placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy
except ImportError as e:  # pragma: no cover - depends on the environment
    raise ImportError("--distributed-executor-backend ray needs Ray: pip install 'ray>=2.40'") from e

from kvtide.config import EngineConfig
from kvtide.engine import serialization
from kvtide.worker.distributed_executor import STARTUP_TIMEOUT_S, DistributedExecutor, Gather, WorkerDiedError
from kvtide.worker.worker import engine_config_from_args, free_port, threads_per_rank

logger = logging.getLogger(__name__)

__all__ = ["RayExecutor", "RayRanks", "RayWorker", "WorkerDiedError", "connect_ray", "placement_bundles"]

LOCAL_OBJECT_STORE_BYTES = 100 * 2**20
"""Object store of a local cluster we start: only small messages travel through it."""
PLACEMENT_TIMEOUT_S = float(os.environ.get("KVTIDE_RAY_PLACEMENT_TIMEOUT_S", "300"))
"""How long the placement group may stay pending (resources held by others) before we give up."""
PLACEMENT_STRATEGIES = ("PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD")
ACTOR_NAME_PREFIX = "kvtide-worker-"
"""Actors are named (kvtide-worker-<replica>-rank<r>) so `ray list actors` shows whose they are."""
_EXIT_AFTER_ERROR_S = 1.0


class RayWorker:
    """A non-driver rank inside a Ray actor. Each reply is msgpack bytes (b"" for none); a failure
    comes back as an "error" reply, after which the actor exits, as a multiprocess worker does, so
    ranks blocked in a collective with it see the connection drop instead of waiting for ever."""

    def __init__(self, rank: int) -> None:
        self.rank = rank
        self.worker = None
        self._stop = threading.Event()
        logging.basicConfig(level=logging.WARNING,
                            format=f"[rank {rank}] %(levelname)s %(name)s: %(message)s")

    def node(self) -> bytes:
        """Where this rank runs: ["node", rank, ip, pid, gpu ids]."""
        return serialization.encode(["node", self.rank, ray.util.get_node_ip_address(), os.getpid(),
                            [str(g) for g in ray.get_gpu_ids()]])

    def prepare(self, engine_args_json: str, model_dir: str) -> bytes:
        """Rebuild the config before joining the process group: a node without the checkpoint or
        with another kvtide fails here, fast, instead of leaving rank 0 waiting in the rendezvous."""
        def check() -> bytes:
            engine_config_from_args(json.loads(engine_args_json), model_dir)
            return serialization.encode(["prepared", self.rank])

        return self._guard(check)

    def start(self, engine_args_json: str, model_dir: str, init_method: str) -> bytes:
        from kvtide.worker.worker import Worker

        def build() -> bytes:
            self.worker = Worker(json.loads(engine_args_json), model_dir, self.rank, init_method)
            return serialization.encode(self.worker.ready_message())

        return self._guard(build)

    def handle(self, data: bytes) -> bytes:
        def run() -> bytes:
            if self.worker is None:
                raise RuntimeError("the worker was not started")
            reply = self.worker.handle(serialization.decode(data))
            return b"" if reply is None else serialization.encode(reply)

        return self._guard(run)

    @ray.method(concurrency_group="watch")
    def watch(self) -> bytes:
        """Never returns: its reference resolves, with an error, when the actor dies (the driver's
        death notice for this rank, in a thread of its own beside the messages)."""
        self._stop.wait()
        return b""

    def _guard(self, fn: Callable[[], bytes]) -> bytes:
        try:
            return fn()
        except BaseException:
            reply = serialization.encode(["error", self.rank, traceback.format_exc()])
            threading.Timer(_EXIT_AFTER_ERROR_S, os._exit, (1,)).start()
            return reply


# ---- the cluster ----------------------------------------------------------------------------------
def _running_cluster_address() -> str | None:
    """The GCS address `ray start` recorded on this node, if that cluster still answers (a stale
    record would make ray.init wait for minutes)."""
    try:
        from ray._private.utils import read_ray_address

        address = read_ray_address()
    except Exception:
        temp = os.environ.get("RAY_TMPDIR") or os.environ.get("TMPDIR") or tempfile.gettempdir()
        path = os.path.join(temp, "ray", "ray_current_cluster")
        try:
            with open(path) as f:
                address = f.read().strip()
        except OSError:
            address = None
    if not address:
        return None
    host, _, port = address.rpartition(":")
    try:
        socket.create_connection((host, int(port)), timeout=2.0).close()
    except (OSError, ValueError):
        logger.info("the Ray cluster recorded at %s does not answer; starting a local one", address)
        return None
    return address


def connect_ray() -> bool:
    """Join a Ray cluster, as vLLM does: keep this process's connection if it has one, else the
    cluster RAY_ADDRESS names, else the one `ray start` runs on this node, else start a local one
    (no dashboard, a small object store). True if we started the cluster (we then stop it)."""
    if ray.is_initialized():
        logger.info("Ray is already initialized; using its cluster")
        return False
    address = os.environ.get("RAY_ADDRESS") or _running_cluster_address()
    if address:
        try:
            ray.init(address=address)
        except ConnectionError as e:
            raise ConnectionError(f"cannot reach the Ray cluster at {address} ({e}); start it with "
                                  f"`ray start --head --port 6379` or unset RAY_ADDRESS") from e
        logger.info("joined the Ray cluster at %s", address)
        return False
    ray.init(include_dashboard=False, object_store_memory=LOCAL_OBJECT_STORE_BYTES)
    logger.info("started a local Ray cluster: %s", ray.cluster_resources())
    return True


def placement_bundles(config: EngineConfig) -> list[dict[str, float]]:
    """One bundle per rank: its CPU threads, or its GPU."""
    if config.device_config.device == "cuda":
        return [{"GPU": 1.0} for _ in range(config.parallel_config.world_size)]
    return [{"CPU": float(threads_per_rank(config))} for _ in range(config.parallel_config.world_size)]


def check_cluster(bundles: list[dict[str, float]], driver_ip: str) -> None:
    """The replica fits the cluster: in total, in each bundle, and rank 0's share on this node
    (ValueError in vLLM's words otherwise, before anything is reserved)."""
    kind = "GPU" if "GPU" in bundles[0] else "CPU"
    per_rank = bundles[0][kind]
    needed = sum(b[kind] for b in bundles)
    total = ray.cluster_resources().get(kind, 0.0)
    hint = ("lower --cpu-threads-per-rank, " if kind == "CPU" else "") + \
        "lower --tensor-parallel-size / --pipeline-parallel-size, or add nodes (`ray start --address HEAD:6379`)"
    if needed > total:
        raise ValueError(f"The number of required {kind}s exceeds the total number of available {kind}s in the "
                         f"Ray cluster: a replica of {len(bundles)} ranks needs {needed:g} {kind}s ({per_rank:g} per "
                         f"rank), the cluster has {total:g}; {hint}")
    nodes = [n for n in ray.nodes() if n.get("Alive")]
    largest = max((n["Resources"].get(kind, 0.0) for n in nodes), default=0.0)
    if per_rank > largest:
        raise ValueError(f"each rank needs {per_rank:g} {kind}s on one node, and the largest node of the Ray cluster "
                         f"has {largest:g}; {hint}")
    here = [n for n in nodes if n.get("NodeManagerAddress") == driver_ip]
    if here and here[0]["Resources"].get(kind, 0.0) < per_rank:
        raise ValueError(f"Current node has no {kind} available for rank 0 (it needs {per_rank:g}; current node "
                         f"resources: {here[0]['Resources'].get(kind, 0.0):g}). Start the engine on a node of the "
                         f"Ray cluster with {kind}s to spare")


def _wait_placement_group(pg: PlacementGroup, bundles: list[dict[str, float]]) -> None:
    start = time.monotonic()
    ready_ref = pg.ready()
    interval = 10.0
    while time.monotonic() - start < PLACEMENT_TIMEOUT_S:
        ready, _ = ray.wait([ready_ref], timeout=min(interval, PLACEMENT_TIMEOUT_S))
        if ready:
            return
        interval *= 2
        logger.info("waiting %.0f s for a placement group of %s; see `ray status` for what holds the "
                    "cluster's resources", time.monotonic() - start, bundles)
    raise ValueError(f"Cannot provide a placement group of {bundles} within {PLACEMENT_TIMEOUT_S:.0f} seconds. "
                     f"See `ray status` and `ray list nodes` to make sure the cluster has enough free resources")


def _local_gpu_index(gpu_id: str) -> int:
    """Ray's GPU id (as the node lists it) -> this process's CUDA index."""
    visible = [d.strip() for d in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if d.strip()]
    return visible.index(gpu_id) if visible else int(gpu_id)


# ---- the transport --------------------------------------------------------------------------------
class _Calls:
    """One call on every actor: the results still to come, and whose they are."""

    def __init__(self, refs: list[Any]) -> None:
        self.rank_of = {ref: rank for rank, ref in enumerate(refs, start=1)}
        self.pending = list(refs)


class RayRanks:
    """Ranks 1.. as actors in the replica's placement group, rank r on bundle r."""

    def __init__(self, config: EngineConfig, model_dir: str, engine_args: dict[str, Any],
                 placement_strategy: str | None = None) -> None:
        strategy = (placement_strategy or os.environ.get("KVTIDE_RAY_PLACEMENT_STRATEGY") or "PACK").upper()
        if strategy not in PLACEMENT_STRATEGIES:
            raise ValueError(f"placement strategy must be one of {', '.join(PLACEMENT_STRATEGIES)}; got {strategy!r}")
        self.strategy = strategy
        self.config = config
        self.model_dir = model_dir
        if config.device_config.device == "cpu":  # every rank its bundle's threads, whatever its node's cores
            engine_args = dict(engine_args, cpu_threads_per_rank=threads_per_rank(config))
        self.args_json = json.dumps(engine_args)
        self.actors: list[Any] = []
        self.placement_group: PlacementGroup | None = None
        self.device_index: int | None = None
        self._watches: dict[Any, int] = {}
        self._owns_cluster = False
        self._watching = threading.Event()
        self._watch_over = threading.Event()

    def launch(self, gather: Gather) -> str:
        """Join or start a cluster, reserve the bundles, start the actors on theirs, check each can
        build its config; returns the process group's init_method (on rank 0's node)."""
        self._owns_cluster = connect_ray()
        cuda = self.config.device_config.device == "cuda"
        driver_ip = ray.util.get_node_ip_address()
        bundles = placement_bundles(self.config)
        check_cluster(bundles, driver_ip)
        if f"node:{driver_ip}" in ray.cluster_resources():
            bundles[0][f"node:{driver_ip}"] = 0.001  # rank 0 runs here, in this process
        else:
            logger.warning("this process is not on a node of the Ray cluster; rank 0's bundle may be reserved "
                           "elsewhere")
        self.placement_group = placement_group(bundles, strategy=self.strategy, name=f"kvtide-{uuid.uuid4().hex[:8]}")
        _wait_placement_group(self.placement_group, bundles)
        if cuda:
            probe = ray.remote(num_cpus=0, num_gpus=1)(lambda: [str(g) for g in ray.get_gpu_ids()])
            gpu_ids = ray.get(probe.options(scheduling_strategy=PlacementGroupSchedulingStrategy(
                self.placement_group, placement_group_bundle_index=0)).remote(), timeout=STARTUP_TIMEOUT_S)
            self.device_index = _local_gpu_index(gpu_ids[0])
        actor_class = ray.remote(concurrency_groups={"watch": 1})(RayWorker)
        replica = self.placement_group.id.hex()[:8]
        for rank in range(1, self.config.parallel_config.world_size):
            self.actors.append(actor_class.options(
                name=f"{ACTOR_NAME_PREFIX}{replica}-rank{rank}",
                num_cpus=0 if cuda else bundles[rank]["CPU"], num_gpus=1 if cuda else 0,
                scheduling_strategy=PlacementGroupSchedulingStrategy(
                    self.placement_group, placement_group_bundle_index=rank),
            ).remote(rank))
        self._watches = {a.watch.remote(): rank for rank, a in enumerate(self.actors, start=1)}
        nodes = gather(self._call("node"), "node", STARTUP_TIMEOUT_S)
        gather(self._call("prepare", self.args_json, self.model_dir), "prepared", STARTUP_TIMEOUT_S)
        if all(n[2] == driver_ip for n in nodes):
            host = "127.0.0.1"
        else:
            host = driver_ip
            logger.info("ranks on nodes %s", sorted({n[2] for n in nodes} | {driver_ip}))
        return f"tcp://{host}:{free_port(host)}"

    def join(self, init_method: str) -> _Calls:
        return self._call("start", self.args_json, self.model_dir, init_method)

    def send(self, data: bytes) -> _Calls:
        return self._call("handle", data)

    def poll(self, sent: _Calls, timeout_s: float) -> bytes | None:
        if not sent.pending:
            time.sleep(timeout_s)
            return None
        ready, sent.pending = ray.wait(sent.pending, num_returns=1, timeout=timeout_s)
        if not ready:
            return None
        try:
            return ray.get(ready[0])
        except ray.exceptions.RayError as e:
            raise WorkerDiedError(f"worker rank {sent.rank_of[ready[0]]} died: {type(e).__name__}: {e}") from e

    def pending(self, sent: _Calls) -> bool:
        return bool(sent.pending)

    def lost_rank(self) -> str | None:
        return None  # the watches tell, in wait_for_lost_rank

    def wait_for_lost_rank(self, closing: threading.Event) -> str | None:
        """Wait on every actor's `watch` call: one returning means that actor is gone."""
        self._watching.set()
        try:
            return self._first_death(closing)
        finally:
            self._watch_over.set()

    def close(self) -> None:
        """Kill the actors, free the placement group; stop the Ray cluster only if we started it."""
        for actor in self.actors:
            try:
                ray.kill(actor, no_restart=True)
            except Exception as e:
                logger.debug("killing a worker actor: %s", e)
        self.actors = []
        if self.placement_group is not None:
            try:
                remove_placement_group(self.placement_group)
            except Exception as e:
                logger.debug("removing the placement group: %s", e)
            self.placement_group = None
        if self._watching.is_set():  # no ray.wait of the monitor's may outlive the connection
            self._watch_over.wait(timeout=5)
        if self._owns_cluster and ray.is_initialized():
            ray.shutdown()

    def _call(self, method: str, *args: Any) -> _Calls:
        return _Calls([getattr(actor, method).remote(*args) for actor in self.actors])

    def _first_death(self, closing: threading.Event) -> str | None:
        watches = dict(self._watches)
        while watches and not closing.is_set():
            try:
                ready, _ = ray.wait(list(watches), num_returns=1, timeout=1.0)
            except Exception as e:  # the connection to the cluster itself is gone
                return f"lost the Ray cluster: {type(e).__name__}: {e}"
            if not ready:
                continue
            rank = watches.pop(ready[0])
            try:
                ray.get(ready[0])
            except ray.exceptions.RayError as e:
                return f"worker rank {rank} died: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
            return f"worker rank {rank} stopped"
        return None


class RayExecutor(DistributedExecutor):
    """A replica whose ranks 1.. are Ray actors."""

    def __init__(self, config: EngineConfig, model_dir: str, engine_args: dict[str, Any],
                 placement_strategy: str | None = None) -> None:
        """`engine_args`: the EngineArgs `config` came from, as a dict (actors rebuild it).
        `placement_strategy`: Ray's PACK (default; KVTIDE_RAY_PLACEMENT_STRATEGY), SPREAD, ..."""
        self.ranks = RayRanks(config, model_dir, engine_args, placement_strategy)
        super().__init__(config, model_dir, self.ranks)

    @property
    def actors(self) -> list[Any]:
        """The worker actors, rank 1 first."""
        return self.ranks.actors

    @property
    def placement_group(self) -> PlacementGroup | None:
        return self.ranks.placement_group
