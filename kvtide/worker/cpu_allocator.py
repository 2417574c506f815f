"""Memory placement for CPU inference: large activations on reused heap pages, the KV pool moved
onto huge pages once the engine runs.

glibc serves allocations above its mmap threshold (dynamic, at most 32 MiB) with fresh mmap()ed
pages and unmaps them on free, so every prefill step's large activations (e.g. 8k tokens x 4096
floats = 128 MiB) are mapped, faulted in page by page and unmapped (with a TLB shootdown across
the worker threads) anew. On the bench model's 8k-token prefill step that was 5.9 s vs 5.0-5.5 s. Raising the threshold (and the trim threshold, so
freed memory is kept for the next step) serves them from the heap instead; this is what vLLM's
CPU docs get by preloading tcmalloc. The process keeps its peak memory instead of returning it,
the right trade for a long-running engine.

The KV pool is read in 4 KiB runs (one block of one KV head) scattered over the whole pool, so
with 4 KiB pages nearly every block read also misses the TLB and starts a page walk.
On 2 MiB transparent huge pages (madvise(MADV_HUGEPAGE) and MADV_COLLAPSE, after the first step,
on a thread of their own, paced) the decode attention call took 12-13% less time
(scripts/bench_cpu_attention.py, 64 rows x 128-384 tokens, a Xeon with AVX-512).
KVTIDE_HUGE_PAGES=0 keeps 4 KiB pages.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import errno
import functools
import logging
import os
import queue
import sys
import threading
import time
import weakref

import torch

logger = logging.getLogger(__name__)

_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
_THRESHOLD = 1 << 30
_tuned = False

_MADV_HUGEPAGE = 14
_MADV_COLLAPSE = 25  # Linux 6.1+; older kernels answer EINVAL and the pages stay as they are
_HUGE_PAGE = 2 << 20


@functools.cache
def _libc() -> ctypes.CDLL | None:
    """glibc, found once (find_library runs a subprocess); None where it cannot be loaded."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    except OSError:
        return None
    if hasattr(libc, "madvise"):
        libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    return libc


def keep_large_allocations_on_heap() -> bool:
    """Set glibc's mmap and trim thresholds to 1 GiB, once per process. False where there is no
    glibc (macOS, musl) or it refused; nothing else changes then."""
    global _tuned
    if _tuned:
        return True
    if not sys.platform.startswith("linux"):
        return False
    mallopt = getattr(_libc(), "mallopt", None)
    if mallopt is None:
        return False
    _tuned = bool(mallopt(_M_MMAP_THRESHOLD, _THRESHOLD)) and bool(mallopt(_M_TRIM_THRESHOLD, _THRESHOLD))
    if _tuned:
        logger.debug("glibc mallopt: mmap and trim thresholds at %d bytes", _THRESHOLD)
    return _tuned


def advise_huge_pages(tensor: torch.Tensor) -> int:
    """MADV_HUGEPAGE over a contiguous CPU tensor's whole 2 MiB-aligned pages: pages faulted in from
    now on come as transparent huge pages (collapse_in_background moves those already there).
    Returns the bytes advised; 0 where nothing was (not Linux, not CPU, not contiguous, under 2 MiB,
    KVTIDE_HUGE_PAGES=0). The kernel may still decline (THP set to never, no free huge pages): the
    tensor works the same."""
    span = _advise(tensor)
    return 0 if span is None else span[1] - span[0]


def _advise(tensor: torch.Tensor) -> tuple[int, int] | None:
    """MADV_HUGEPAGE over the tensor's whole 2 MiB pages; their (start, end) address, or None."""
    if (tensor.device.type != "cpu" or not tensor.is_contiguous() or not sys.platform.startswith("linux")
            or os.environ.get("KVTIDE_HUGE_PAGES", "1") == "0"):
        return None
    start = tensor.data_ptr()
    end = start + tensor.numel() * tensor.element_size()
    first, last = -(-start // _HUGE_PAGE) * _HUGE_PAGE, end // _HUGE_PAGE * _HUGE_PAGE
    libc = _libc()
    if last <= first or not hasattr(libc, "madvise"):
        return None
    if libc.madvise(first, last - first, _MADV_HUGEPAGE) != 0:
        return None
    return first, last


COLLAPSE_DUTY = 0.1
"""The share of one core the background collapse may take: it sleeps 9x as long as each huge page
took. Collapsing a 1 GiB pool in one call took 1.6-7 s of a core on a 2-core KVM guest (~6 ms a huge
page, some 80 ms), and the first requests of a load arriving then waited 1-2.4 s for their first
token (S1 on the bench model: TTFT p99 2.3-2.6 s, against 0.52 s on 4 KiB pages and 0.48 s paced).
Paced, the pool moved in about 80 s there; the huge pages are worth 1-2% of throughput meanwhile."""


def _collapse_paced(ref: weakref.ref) -> None:
    """MADV_HUGEPAGE, then MADV_COLLAPSE on the tensor `ref` names, one huge page at a time at
    COLLAPSE_DUTY of a core; stops once the tensor is freed (never holds it between pages)."""
    tensor = ref()
    span = None if tensor is None else _advise(tensor)
    del tensor
    if span is None:
        return
    madvise = _libc().madvise
    for address in range(span[0], span[1], _HUGE_PAGE):
        if ref() is None:
            return
        began = time.perf_counter()
        if madvise(address, _HUGE_PAGE, _MADV_COLLAPSE) != 0 and ctypes.get_errno() == errno.EINVAL:
            return  # a kernel before 6.1: no MADV_COLLAPSE at all
        time.sleep((time.perf_counter() - began) * (1 / COLLAPSE_DUTY - 1))


def collapse_in_background(tensors: list[torch.Tensor]) -> None:
    """Move the tensors onto huge pages from a background thread, one huge page at a time at
    COLLAPSE_DUTY of a core and at the lowest CPU priority; a tensor freed before its turn is
    skipped. On a KVM guest, fresh huge pages for a 1 GiB pool took 0.85-3.96 s to fault in (asked
    for before zeroing it) against 0.25 s to zero it on the heap's 4 KiB pages: the engine starts on
    4 KiB pages and hands its pool here after its first step. The kernel collapses a live range
    safely (khugepaged does the same to running processes); the engine keeps serving meanwhile."""
    if os.environ.get("KVTIDE_HUGE_PAGES", "1") == "0":
        return
    for tensor in tensors:
        if tensor.device.type == "cpu":
            _collapse_queue().put(weakref.ref(tensor))


def wait_for_huge_pages() -> None:
    """Return once every tensor collapse_in_background was given has been advised and collapsed."""
    _collapse_queue().join()


@functools.cache
def _collapse_queue() -> queue.Queue:
    """The queue one daemon thread drains: madvise() releases the GIL, so it runs beside the engine."""
    tensors: queue.Queue = queue.Queue()

    def drain() -> None:
        with contextlib.suppress(OSError, AttributeError):  # Linux: this thread alone, the engine first
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)
        while True:
            ref = tensors.get()
            try:
                _collapse_paced(ref)
            except Exception as e:  # advice only: the tensor works the same on 4 KiB pages
                logger.debug("huge pages not advised: %s", e)
            finally:
                tensors.task_done()

    threading.Thread(target=drain, name="kvtide-huge-pages", daemon=True).start()
    return tensors


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_collapse_queue.cache_clear)  # a forked child starts its own thread
