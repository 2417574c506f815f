"""Fixtures the bench tests share."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="module")
def tokenizer():
    """The byte-level tokenizer of the tiny checkpoints (sizes prompts without a model)."""
    from kvtide.models.demo import build_byte_tokenizer

    return build_byte_tokenizer()
