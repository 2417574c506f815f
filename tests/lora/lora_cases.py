"""LoRA test cases shared by the tests here: PEFT adapters made on a tiny base checkpoint, and each
merged into its base (`merge_and_unload`) as Hugging Face's reference."""

from __future__ import annotations

import os
import shutil
from dataclasses import dataclass

import torch

ATTENTION = ["q_proj", "k_proj", "v_proj", "o_proj"]
MLP = ["gate_proj", "up_proj", "down_proj"]

ADAPTERS = {
    # name: (rank, alpha, target modules, use_rslora, seed)
    "attn-r8": (8, 16, ATTENTION, False, 1),
    "all-r16-rslora": (16, 32, ATTENTION + MLP, True, 2),
    "mlp-r4": (4, 4, MLP, False, 3),
}
"""Three adapters of different ranks and targets (fused qkv and gate_up adapted slice-wise)."""


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
