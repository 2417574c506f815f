"""Fixtures for the batch tests: the tiny Llama of tests/conftest.py, and the HF reference helpers of
tests/models (imported by module name, as the other folders share theirs)."""

from __future__ import annotations

import os
import sys

_MODELS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "models")
if _MODELS not in sys.path:
    sys.path.insert(0, _MODELS)

ENGINE_FLAGS = ["--max-model-len", "256", "--max-num-seqs", "8"]
"""A small engine: the CPU KV cache it allocates is bounded by max_num_seqs * max_model_len."""
