"""keep_large_allocations_on_heap: large activations come from glibc's heap, not fresh mmaps;
collapse_in_background: the KV pool moved onto transparent huge pages by a background thread."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from kvtide.worker.cpu_allocator import advise_huge_pages

_PROBE = """
import sys, torch
if sys.argv[1] == "tuned":
    from kvtide.worker.cpu_allocator import keep_large_allocations_on_heap
    assert keep_large_allocations_on_heap()
x = torch.ones(64 << 20 >> 2)  # 64 MiB: above glibc's largest dynamic mmap threshold (32 MiB)
heap = next(line for line in open("/proc/self/maps") if line.rstrip().endswith("[heap]"))
start, end = (int(a, 16) for a in heap.split()[0].split("-"))
print(int(start <= x.data_ptr() < end))
"""


def _on_heap(mode: str) -> bool:
    out = subprocess.run([sys.executable, "-c", _PROBE, mode], capture_output=True, text=True, check=True)
    return out.stdout.strip().splitlines()[-1] == "1"


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc mallopt is Linux-only")
def test_large_activations_are_served_from_the_heap():
    assert not _on_heap("default")  # glibc's default: a fresh mmap, unmapped again on free
    assert _on_heap("tuned")


_HUGE_PROBE = """
import torch
from kvtide.worker.cpu_allocator import collapse_in_background, keep_large_allocations_on_heap, wait_for_huge_pages
assert keep_large_allocations_on_heap()  # as the engine does: the pool reuses heap pages
junk = torch.ones(96 << 20 >> 2)  # pages the heap has faulted in, kept after the free
del junk
x = torch.zeros(64 << 20 >> 2)
freed = torch.zeros(8 << 20 >> 2)
collapse_in_background([x, freed])
del freed  # a pool freed before its turn is skipped
x[::1024] = 3.0  # written while the background thread collapses the range: nothing is lost
wait_for_huge_pages()
assert (x[::1024] == 3.0).all() and int((x != 0).sum()) == x.numel() // 1024
lo, hi, huge, inside = x.data_ptr(), x.data_ptr() + x.numel() * 4, 0, False
for line in open("/proc/self/smaps"):
    head = line.split()[0]
    if "-" in head and not head.endswith(":"):
        start, end = (int(a, 16) for a in head.split("-"))
        inside = start < hi and lo < end
    elif inside and head == "AnonHugePages:":
        huge += int(line.split()[1]) << 10
print(huge)
"""


def _huge_bytes(env: dict[str, str]) -> int:
    out = subprocess.run([sys.executable, "-c", _HUGE_PROBE], capture_output=True, text=True, check=True,
                         env={**os.environ, **env})
    return int(out.stdout.strip().splitlines()[-1])


def _thp_mode() -> str:
    try:
        text = open("/sys/kernel/mm/transparent_hugepage/enabled").read()
    except OSError:
        return "absent"
    return text[text.index("[") + 1:text.index("]")]


@pytest.mark.skipif(_thp_mode() not in ("madvise", "always"),
                    reason="the kernel offers no transparent huge pages (THP set to never, or absent)")
def test_kv_pool_lands_on_huge_pages():
    # 64 MiB zeroed; all but the unaligned ends (< 4 MiB) can be 2 MiB pages, including the part
    # the heap had already faulted in as 4 KiB pages (collapsed)
    assert _huge_bytes({}) >= 56 << 20
    if _thp_mode() == "madvise":  # not asked for: 4 KiB pages
        assert _huge_bytes({"KVTIDE_HUGE_PAGES": "0"}) == 0


def test_advise_huge_pages_declines_what_it_cannot_advise(monkeypatch):
    assert advise_huge_pages(torch.zeros(1024)) == 0  # under one aligned 2 MiB page
    assert advise_huge_pages(torch.zeros(8 << 20 >> 2)[::2]) == 0  # not contiguous
    monkeypatch.setenv("KVTIDE_HUGE_PAGES", "0")
    assert advise_huge_pages(torch.zeros(8 << 20 >> 2)) == 0
