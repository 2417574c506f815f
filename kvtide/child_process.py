"""What a process kvtide starts (an engine core, a worker rank) does first: it dies with its parent,
and keeps to its share of the machine's CPUs. Below the engine and the workers alike, so both take
it from here.
"""

from __future__ import annotations

import logging
import os
import signal
import sys

logger = logging.getLogger(__name__)


def die_with_parent() -> None:
    """Ask Linux to SIGKILL this process when its parent dies (no orphan holding memory, even one
    blocked in a collective)."""
    if not sys.platform.startswith("linux"):
        return
    try:
        import ctypes

        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        pr_set_pdeathsig = 1
        libc.prctl(pr_set_pdeathsig, signal.SIGKILL)
    except OSError:
        pass


def set_cpu_share(cpu_affinity: str | None, cpu_threads: int | None) -> None:
    """Pin this process to its cores and size torch's thread pool, before any model code runs: a
    data-parallel replica keeps to its share of the machine instead of every replica running one
    thread per core of the whole node. Worker threads started later (async scheduling) inherit both."""
    if cpu_affinity and hasattr(os, "sched_setaffinity"):
        cpus = {int(c) for c in cpu_affinity.split(",") if c.strip()}
        try:
            os.sched_setaffinity(0, cpus)
        except OSError as e:
            logger.warning("cannot pin the engine core to CPUs %s (%s); it runs unpinned", cpu_affinity, e)
    if cpu_threads is not None:
        import torch

        torch.set_num_threads(max(1, cpu_threads))
