"""Process groups of one engine replica and the collectives the parallel layers call.

Ranks of a replica are laid out stage-major, as Megatron and vLLM do:

    rank = pp_rank * tp_size + tp_rank        TP group: the tp_size ranks of one stage
                                              PP group: the pp_size ranks of one tp_rank

The expert-parallel group of a replica is its TP group (vLLM's `--enable-expert-parallel` with data
parallelism 1): the same ranks either split every expert's matrices (TP) or own whole experts (EP).
With data parallelism and `--enable-expert-parallel`, the replicas' engine-core processes (each a
replica of one rank) form one more group, `init_replica_expert_group`: the EP group then spans the
replicas, each with its own batch, and they step in lockstep (engine/core_proc.py).

Until `init_distributed` runs, every group is the trivial one: world size 1 creates no process
group, and each collective returns its input untouched, so a single-device engine pays nothing.
Every collective a group runs is counted in `CommStats` (bytes sent by this rank, seconds), the
figures the benchmark reports per step.
"""

from __future__ import annotations

import logging
import time
from collections import defaultdict
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

logger = logging.getLogger(__name__)


@dataclass
class CommStats:
    """Per collective kind: calls, bytes this rank sent (payload as the algorithm-independent
    volume, see `GroupCoordinator`), seconds spent inside the call."""

    calls: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    bytes: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    seconds: dict[str, float] = field(default_factory=lambda: defaultdict(float))

    def add(self, kind: str, nbytes: int, seconds: float) -> None:
        self.calls[kind] += 1
        self.bytes[kind] += nbytes
        self.seconds[kind] += seconds

    def snapshot(self) -> dict[str, dict[str, float]]:
        return {kind: {"calls": self.calls[kind], "bytes": self.bytes[kind], "seconds": self.seconds[kind]}
                for kind in sorted(self.calls)}

    def reset(self) -> None:
        self.calls.clear()
        self.bytes.clear()
        self.seconds.clear()


COMM_STATS = CommStats()


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


class GroupCoordinator:
    """One group of ranks (`ranks`, global ids) and this process's place in it. With one rank and no
    process group every collective is the identity.

    Bytes are counted as the data a rank must send in the textbook algorithm, whatever gloo or NCCL
    does underneath: all-reduce 2(n-1)/n x size (ring), all-gather (n-1)/n x the output, all-to-all
    what leaves this rank for others, send its size."""

    def __init__(self, ranks: list[int], rank: int, group: dist.ProcessGroup | None, name: str) -> None:
        self.ranks = ranks
        self.world_size = len(ranks)
        self.rank_in_group = ranks.index(rank)
        self.group = group
        self.name = name

    @property
    def is_first_rank(self) -> bool:
        return self.rank_in_group == 0

    @property
    def is_last_rank(self) -> bool:
        return self.rank_in_group == self.world_size - 1

    def _timed(self, kind: str, nbytes: int, fn) -> None:
        start = time.perf_counter()
        fn()
        COMM_STATS.add(f"{self.name}.{kind}", nbytes, time.perf_counter() - start)

    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        """Sum over the group, in place; returns `t`."""
        if self.world_size == 1:
            return t
        n = self.world_size
        self._timed("all_reduce", _nbytes(t) * 2 * (n - 1) // n, lambda: dist.all_reduce(t, group=self.group))
        return t

    def all_gather(self, t: torch.Tensor, dim: int = -1) -> torch.Tensor:
        """Every rank's `t` concatenated along `dim`, in rank order."""
        if self.world_size == 1:
            return t
        parts = [torch.empty_like(t) for _ in range(self.world_size)]
        self._timed("all_gather", _nbytes(t) * (self.world_size - 1),
                    lambda: dist.all_gather(parts, t.contiguous(), group=self.group))
        return torch.cat(parts, dim=dim)

    def broadcast(self, t: torch.Tensor, src: int = 0) -> torch.Tensor:
        """`t` of the group's rank `src` (an index into the group), in place on every rank."""
        if self.world_size == 1:
            return t
        sent = _nbytes(t) * (self.world_size - 1) if self.rank_in_group == src else 0
        self._timed("broadcast", sent, lambda: dist.broadcast(t, self.ranks[src], group=self.group))
        return t

    def send(self, t: torch.Tensor, dst: int) -> None:
        """To the group's rank `dst`; the receiver must know the shape and dtype."""
        self._timed("send", _nbytes(t), lambda: dist.send(t.contiguous(), self.ranks[dst], group=self.group))

    def recv(self, t: torch.Tensor, src: int) -> torch.Tensor:
        """Into `t` from the group's rank `src`."""
        self._timed("recv", 0, lambda: dist.recv(t, self.ranks[src], group=self.group))
        return t

    def all_to_all(self, output: torch.Tensor, input: torch.Tensor, output_split_sizes: list[int],
                   input_split_sizes: list[int]) -> torch.Tensor:
        """`input`'s rows split by `input_split_sizes` go to each rank in order; `output` receives
        each rank's rows for this one (`all_to_all_single`)."""
        if self.world_size == 1:
            output.copy_(input)
            return output
        row = _nbytes(input) // max(input.shape[0], 1)
        sent = row * (sum(input_split_sizes) - input_split_sizes[self.rank_in_group])
        self._timed("all_to_all", sent, lambda: dist.all_to_all_single(
            output, input.contiguous(), output_split_sizes, input_split_sizes, group=self.group))
        return output

    def barrier(self) -> None:
        if self.world_size > 1:
            dist.barrier(group=self.group)


@dataclass(frozen=True)
class ParallelLayout:
    """Where this process sits in its replica."""

    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    rank: int = 0
    enable_expert_parallel: bool = False
    """MoE layers split whole experts over the EP group (the TP group) instead of each expert's matrices."""

    @property
    def world_size(self) -> int:
        return self.tensor_parallel_size * self.pipeline_parallel_size

    @property
    def tp_rank(self) -> int:
        return self.rank % self.tensor_parallel_size

    @property
    def pp_rank(self) -> int:
        return self.rank // self.tensor_parallel_size

    def tp_ranks(self, pp_rank: int) -> list[int]:
        tp = self.tensor_parallel_size
        return list(range(pp_rank * tp, (pp_rank + 1) * tp))

    def pp_ranks(self, tp_rank: int) -> list[int]:
        return [p * self.tensor_parallel_size + tp_rank for p in range(self.pipeline_parallel_size)]


_LAYOUT = ParallelLayout()
_REPLICA_EP: GroupCoordinator | None = None
"""The expert-parallel group across data-parallel replicas, once this process joined one."""
_REPLICA_SYNC: GroupCoordinator | None = None
_WORLD = GroupCoordinator([0], 0, None, "world")
_TP = GroupCoordinator([0], 0, None, "tp")
_PP = GroupCoordinator([0], 0, None, "pp")


def init_distributed(layout: ParallelLayout, init_method: str, backend: str = "gloo",
                     timeout_s: float = 600.0) -> None:
    """Join the replica's process group (every rank calls this with its own `layout.rank`) and build
    the TP and PP subgroups. World size 1 builds nothing."""
    global _LAYOUT, _WORLD, _TP, _PP
    _LAYOUT = layout
    if layout.world_size == 1:
        return
    import datetime

    dist.init_process_group(backend, init_method=init_method, world_size=layout.world_size,
                            rank=layout.rank, timeout=datetime.timedelta(seconds=timeout_s))
    everyone = list(range(layout.world_size))
    _WORLD = GroupCoordinator(everyone, layout.rank, dist.group.WORLD, "world")
    # new_group is collective: every rank creates every subgroup, in the same order
    for pp_rank in range(layout.pipeline_parallel_size):
        ranks = layout.tp_ranks(pp_rank)
        group = dist.new_group(ranks, backend=backend)
        if layout.rank in ranks:
            _TP = GroupCoordinator(ranks, layout.rank, group, "tp")
    for tp_rank in range(layout.tensor_parallel_size):
        ranks = layout.pp_ranks(tp_rank)
        group = dist.new_group(ranks, backend=backend)
        if layout.rank in ranks:
            _PP = GroupCoordinator(ranks, layout.rank, group, "pp")


def init_replica_expert_group(dp_rank: int, dp_size: int, init_method: str, backend: str = "gloo",
                              timeout_s: float = 600.0) -> None:
    """Join the expert-parallel group of `dp_size` single-rank data-parallel replicas (before the
    model is built: each replica then loads only its share of the experts)."""
    global _LAYOUT, _REPLICA_EP, _REPLICA_SYNC
    import datetime

    dist.init_process_group(backend, init_method=init_method, world_size=dp_size, rank=dp_rank,
                            timeout=datetime.timedelta(seconds=timeout_s))
    ranks = list(range(dp_size))
    _REPLICA_EP = GroupCoordinator(ranks, dp_rank, dist.group.WORLD, "dp_ep")
    # The replicas' step agreement is a few host integers: gloo, beside NCCL's device collectives.
    sync = dist.group.WORLD if backend == "gloo" else dist.new_group(ranks, backend="gloo")
    _REPLICA_SYNC = GroupCoordinator(ranks, dp_rank, sync, "dp_sync")
    _LAYOUT = ParallelLayout(enable_expert_parallel=True)  # the replica's own layout: one rank
    logger.info("joined the expert-parallel group of %d data-parallel replicas as rank %d (%s)", dp_size, dp_rank,
                backend)


def experts_span_replicas() -> bool:
    """Whether the EP group is the data-parallel replicas' (each with its own tokens) rather than
    the replica's TP group (all with the same tokens)."""
    return _REPLICA_EP is not None


def get_replica_sync_group() -> GroupCoordinator | None:
    """The replicas sharing experts, on gloo (host tensors): their lockstep agreement."""
    return _REPLICA_SYNC


def refuse_live_process_group() -> None:
    """Before building a replica in this process: the parallel layers read this process's groups,
    so a second engine beside a live multi-rank one would take its groups."""
    if dist.is_initialized() and _REPLICA_EP is None:
        raise ValueError("this process already runs an engine of several ranks (its process group is live); "
                         "shut that LLM down (llm.shutdown()) before building another one here")


def destroy_distributed() -> None:
    """Leave the process group (a no-op at world size 1) and return to the trivial groups."""
    global _LAYOUT, _WORLD, _TP, _PP, _REPLICA_EP, _REPLICA_SYNC
    if dist.is_initialized():
        dist.destroy_process_group()
    _REPLICA_EP = _REPLICA_SYNC = None
    _LAYOUT = ParallelLayout()
    _WORLD = GroupCoordinator([0], 0, None, "world")
    _TP = GroupCoordinator([0], 0, None, "tp")
    _PP = GroupCoordinator([0], 0, None, "pp")


def get_layout() -> ParallelLayout:
    return _LAYOUT


def get_world_group() -> GroupCoordinator:
    return _WORLD


def get_tp_group() -> GroupCoordinator:
    return _TP


def get_pp_group() -> GroupCoordinator:
    return _PP


def get_ep_group() -> GroupCoordinator:
    """The ranks that split a MoE layer's experts between them: the TP group, or the data-parallel
    replicas' group once joined."""
    return _REPLICA_EP if _REPLICA_EP is not None else _TP


def split_evenly(total: int, parts: int, index: int) -> tuple[int, int]:
    """(start, size) of part `index` of `total` items split into `parts` contiguous pieces, the first
    `total % parts` pieces one larger (layers over pipeline stages)."""
    base, extra = divmod(total, parts)
    start = index * base + min(index, extra)
    return start, base + (1 if index < extra else 0)
