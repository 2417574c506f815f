"""The tiny checkpoints gain nothing from a second thread, and on a busy machine a 2-thread
OpenMP pool waits on its partner at every matmul: these tests run single-threaded."""

from __future__ import annotations

import pytest
import torch


@pytest.fixture(autouse=True)
def _one_torch_thread():
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)
