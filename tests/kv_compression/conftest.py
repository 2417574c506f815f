"""KV-compression engine tests run tiny models on one intra-op thread (see torch_threads.py)."""

from __future__ import annotations

import pytest
from torch_threads import one_torch_thread


@pytest.fixture(autouse=True, scope="package")
def _one_torch_thread():
    yield from one_torch_thread()
