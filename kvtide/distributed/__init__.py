"""Parallelism across processes: process groups and collectives (`parallel_state`), the checks a
parallel configuration must pass (`config_checks`)."""

from kvtide.distributed.parallel_state import (
    COMM_STATS,
    GroupCoordinator,
    ParallelLayout,
    destroy_distributed,
    experts_span_replicas,
    get_ep_group,
    get_layout,
    get_pp_group,
    get_replica_sync_group,
    get_tp_group,
    get_world_group,
    init_distributed,
    init_replica_expert_group,
    refuse_live_process_group,
    split_evenly,
)

__all__ = ["COMM_STATS", "GroupCoordinator", "ParallelLayout", "destroy_distributed", "experts_span_replicas",
           "get_ep_group", "get_layout", "get_pp_group", "get_replica_sync_group", "get_tp_group",
           "get_world_group", "init_distributed", "init_replica_expert_group", "refuse_live_process_group",
           "split_evenly"]
