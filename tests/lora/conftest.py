"""LoRA tests: tiny seeded base checkpoints, PEFT adapters made on them, and each adapter merged into
its base (`merge_and_unload`) as Hugging Face's reference."""

from __future__ import annotations

import os
import shutil
import sys
from dataclasses import dataclass

import pytest
import torch
from torch_threads import one_torch_thread

_MODELS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "models")
if _MODELS not in sys.path:  # hf_reference: the HF oracle the model tests share
    sys.path.insert(0, _MODELS)

ATTENTION = ["q_proj", "k_proj", "v_proj", "o_proj"]
MLP = ["gate_proj", "up_proj", "down_proj"]

ADAPTERS = {
    # name: (rank, alpha, target modules, use_rslora, seed)
    "attn-r8": (8, 16, ATTENTION, False, 1),
    "all-r16-rslora": (16, 32, ATTENTION + MLP, True, 2),
    "mlp-r4": (4, 4, MLP, False, 3),
}
"""Three adapters of different ranks and targets (fused qkv and gate_up adapted slice-wise)."""


@pytest.fixture(autouse=True, scope="package")
def _one_torch_thread():
    yield from one_torch_thread()


@dataclass(frozen=True)
class LoRACase:
    base_dir: str
    adapter_dirs: dict[str, str]
    """Adapter name -> its PEFT directory (adapter_config.json, adapter_model.safetensors)."""
    merged_dirs: dict[str, str]
    """Adapter name -> a full checkpoint of the base with that adapter merged in (HF's reference)."""


def make_peft_adapter(base_dir: str, out_dir: str, rank: int, alpha: float, targets: list[str],
                      use_rslora: bool, seed: int, merged_dir: str | None = None) -> str:
    """A PEFT LoRA adapter on `base_dir` with seeded non-zero B (PEFT starts B at zero), saved to
    `out_dir`; with `merged_dir`, the base with the adapter merged in is saved there too."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    torch.manual_seed(seed)
    peft_model = get_peft_model(model, LoraConfig(r=rank, lora_alpha=alpha, target_modules=targets,
                                                  use_rslora=use_rslora, lora_dropout=0.0, bias="none"))
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in peft_model.named_parameters():
            if "lora_B" in name:
                param.copy_(torch.randn(param.shape, generator=generator) * 0.1)
    peft_model.save_pretrained(out_dir)
    if merged_dir is not None:
        peft_model.merge_and_unload().save_pretrained(merged_dir, safe_serialization=True)
        for name in os.listdir(base_dir):
            if name.startswith(("tokenizer", "special_tokens")):
                shutil.copy(os.path.join(base_dir, name), merged_dir)
    return out_dir


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
