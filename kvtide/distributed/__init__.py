"""Parallelism across processes: process groups and collectives (`parallel_state`), the checks a
parallel configuration must pass (`config_checks`)."""

from kvtide.distributed.parallel_state import (
    COMM_STATS,
    GroupCoordinator,
    ParallelLayout,
    destroy_distributed,
    get_ep_group,
    get_layout,
    get_pp_group,
    get_tp_group,
    get_world_group,
    init_distributed,
    refuse_live_process_group,
    split_evenly,
)

__all__ = ["COMM_STATS", "GroupCoordinator", "ParallelLayout", "destroy_distributed", "get_ep_group",
           "get_layout", "get_pp_group", "get_tp_group", "get_world_group", "init_distributed",
           "refuse_live_process_group", "split_evenly"]
