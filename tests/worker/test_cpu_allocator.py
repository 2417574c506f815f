"""keep_large_allocations_on_heap: large activations come from glibc's heap, not fresh mmaps."""

from __future__ import annotations

import subprocess
import sys

import pytest

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
