"""Model tests run tiny models (hidden 128): one intra-op thread is as fast as two, and OpenMP
barriers stall badly (10-30x) when the two cores are shared with other processes."""

from __future__ import annotations

import pytest
import torch


@pytest.fixture(autouse=True, scope="package")
def _one_torch_thread():
    old = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(old)
