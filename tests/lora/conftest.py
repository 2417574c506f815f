"""LoRA tests: tiny seeded base checkpoints, PEFT adapters made on them, and each adapter merged into
its base (`merge_and_unload`) as Hugging Face's reference."""

from __future__ import annotations

import os
import sys

import pytest
from lora_cases import ADAPTERS, LoRACase, make_peft_adapter
from torch_threads import one_torch_thread

_MODELS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "models")
if _MODELS not in sys.path:  # hf_reference: the HF oracle the model tests share
    sys.path.insert(0, _MODELS)


@pytest.fixture(autouse=True, scope="package")
def _one_torch_thread():
    yield from one_torch_thread()


@pytest.fixture(scope="session")
def lora_case_factory(checkpoint_factory, tmp_path_factory):
    """lora_case_factory(architecture) -> LoRACase, built once per architecture."""
    cases: dict[str, LoRACase] = {}

    def make(architecture: str) -> LoRACase:
        if architecture not in cases:
            base = checkpoint_factory(architecture)
            root = tmp_path_factory.mktemp(f"lora-{architecture.lower()}")
            adapters, merged = {}, {}
            for name, (rank, alpha, targets, rslora, seed) in ADAPTERS.items():
                merged[name] = str(root / f"{name}-merged")
                adapters[name] = make_peft_adapter(base, str(root / name), rank, alpha, targets, rslora, seed,
                                                   merged[name])
            cases[architecture] = LoRACase(base, adapters, merged)
        return cases[architecture]

    return make
