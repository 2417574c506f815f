"""What the engine core reports about its LoRA adapters (SchedulerStats.lora), in plain Python."""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable

RECENT_LOADS = 64
"""Load times sent with each report: the scraper observes those it has not seen (by the count)."""


def lora_stats(running: Iterable, waiting: Iterable, max_loras: int, names: dict[int, str],
               runner_stats: dict) -> dict:
    """{"running"/"waiting": adapter name -> requests, "max_lora", "resident": names in the slots,
    "num_loads" and "recent_load_seconds" (the last RECENT_LOADS loads)} from the scheduler's
    requests and the runner's LoRA state (lora/model_state.py stats)."""
    def count(requests: Iterable) -> dict[str, int]:
        return dict(Counter(r.lora_request.lora_name for r in requests if r.lora_request is not None))

    loads = runner_stats.get("load_seconds", [])
    return {"running": count(running), "waiting": count(waiting), "max_lora": max_loras,
            "resident": [names.get(i, str(i)) for i in runner_stats.get("resident", [])],
            "num_loads": len(loads), "recent_load_seconds": loads[-RECENT_LOADS:]}
