"""Shared fixtures: tiny seeded Hugging Face checkpoints, built once per test session."""

from __future__ import annotations

import json
import os

import pytest
import torch

from kvtide.models.demo import make_random_checkpoint

torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))


@pytest.fixture(scope="session")
def checkpoint_factory(tmp_path_factory):
    """checkpoint_factory(architecture="LlamaForCausalLM", seed=0, **config) -> directory.

    Same arguments, same directory: each distinct checkpoint is written once per session."""
    cache: dict[str, str] = {}

    def make(architecture: str = "LlamaForCausalLM", seed: int = 0, **config) -> str:
        key = json.dumps([architecture, seed, config], sort_keys=True, default=str)
        if key not in cache:
            path = str(tmp_path_factory.mktemp(architecture.lower()))
            cache[key] = make_random_checkpoint(path, architecture, seed=seed, **config)
        return cache[key]

    return make


@pytest.fixture(scope="session")
def llama_dir(checkpoint_factory) -> str:
    """The default tiny Llama (GQA 4:2, hidden 128, 4 layers, byte tokenizer)."""
    return checkpoint_factory("LlamaForCausalLM")
