"""Where the data-parallel replicas of this node run: disjoint CPU slices with their thread
counts, or GPUs each (CUDA_VISIBLE_DEVICES). Shared by the head (dp_client.py) and a headless node
(dp_remote.py); the accelerators themselves are kvtide/devices.py's to find."""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
from collections.abc import Sequence
from typing import Any

from kvtide import devices

logger = logging.getLogger(__name__)


@dataclasses.dataclass
class ReplicaPlacement:
    """Where one replica runs on this node."""

    rank: int
    cpu_affinity: list[int] | None = None
    cpu_threads: int | None = None
    env: dict[str, str] = dataclasses.field(default_factory=dict)


def _usable_cpus() -> list[int]:
    if hasattr(os, "sched_getaffinity"):
        return sorted(os.sched_getaffinity(0))
    return list(range(os.cpu_count() or 1))


def omp_threads_env() -> int | None:
    with contextlib.suppress(ValueError):
        value = int(os.environ.get("OMP_NUM_THREADS", ""))
        if value >= 1:
            return value
    return None


def plan_replicas(num_replicas: int, device: str, world_size: int = 1, cpu_threads_per_rank: int | None = None,
                  cpus: Sequence[int] | None = None, visible_gpus: Sequence[str] | None = None,
                  omp_threads: int | None = None) -> list[ReplicaPlacement]:
    """Split this node between the replicas. CPU: consecutive, disjoint core slices (a replica's
    torch threads then never compete with another's), threads = the slice (or
    cpu_threads_per_rank, or fewer with OMP_NUM_THREADS). CUDA: world_size GPUs each."""
    if device == "cuda":
        gpus = list(visible_gpus or [])
        needed = num_replicas * world_size
        if len(gpus) < needed:
            raise ValueError(f"data_parallel_size={num_replicas} replicas of {world_size} GPU(s) each need "
                             f"{needed} GPUs; {len(gpus)} are visible")
        return [ReplicaPlacement(r, env={"CUDA_VISIBLE_DEVICES": ",".join(gpus[r * world_size:(r + 1) * world_size])})
                for r in range(num_replicas)]
    cpus = list(cpus if cpus is not None else _usable_cpus())
    share = len(cpus) // num_replicas
    placements = []
    for r in range(num_replicas):
        if share == 0:  # fewer cores than replicas: they share them all, one thread each
            placements.append(ReplicaPlacement(r, None, 1))
            continue
        threads = cpu_threads_per_rank or share
        if omp_threads is not None and cpu_threads_per_rank is None:
            threads = min(threads, omp_threads)
        # A multi-rank replica splits its slice between its ranks itself.
        placements.append(ReplicaPlacement(r, cpus[r * share:(r + 1) * share], threads if world_size == 1 else None))
    if share == 0:
        logger.warning("%d data-parallel replicas on %d usable CPUs: they share the cores, one torch thread each",
                       num_replicas, len(cpus))
    return placements


def place_local_replicas(engine_args: Any, num_local: int) -> list[ReplicaPlacement]:
    """This node's `num_local` replicas of `engine_args`, each of its tensor x pipeline ranks' size."""
    world = engine_args.tensor_parallel_size * engine_args.pipeline_parallel_size
    cuda = devices.uses_cuda(engine_args.device)
    return plan_replicas(num_local, "cuda" if cuda else "cpu", world, engine_args.cpu_threads_per_rank,
                         visible_gpus=devices.visible_gpus() if cuda else None, omp_threads=omp_threads_env())
