"""LLM programs on the default tiny Llama (byte tokenizer, the demo chat template), on one intra-op
thread; hf_reference (tests/models) is the oracle for select's scores."""

from __future__ import annotations

import os
import sys

import pytest
from torch_threads import one_torch_thread

_MODELS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "models")
if _MODELS not in sys.path:
    sys.path.insert(0, _MODELS)

@pytest.fixture(autouse=True, scope="package")
def _one_torch_thread():
    yield from one_torch_thread()
