"""Fixtures shared by the layer kernel tests."""

from __future__ import annotations

import pytest
import torch


@pytest.fixture(scope="module")
def one_intra_op_thread():
    """One intra-op thread for a module, as the model tests run (OpenMP barriers stall on shared
    cores); a test that needs two sets them itself."""
    old = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(old)
