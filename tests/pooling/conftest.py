"""Pooling tests run tiny seeded checkpoints (hidden 128) on one intra-op thread."""

from __future__ import annotations

import pytest
from torch_threads import one_torch_thread


@pytest.fixture(autouse=True, scope="package")
def _one_torch_thread():
    yield from one_torch_thread()
