"""One intra-op thread for the length of a fixture: tiny models run as fast on one as on two, and
OpenMP barriers stall badly (10-30x) when the two cores are shared with other processes."""

from __future__ import annotations

from collections.abc import Iterator

import torch


def one_torch_thread() -> Iterator[None]:
    old = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(old)
