"""A PEFT adapter's adapter_config.json, read and checked before any weight is loaded."""

from __future__ import annotations

import json
import math
import os
import re
from dataclasses import dataclass

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"


@dataclass(frozen=True)
class PEFTAdapterConfig:
    rank: int
    lora_alpha: float
    target_modules: tuple[str, ...] | str
    """Module names (a module matches when its name ends with one) or, as a string, a regex its
    whole name must match; "all-linear" targets every linear but the LM head."""
    use_rslora: bool

    @property
    def scaling(self) -> float:
        """What B(Ax) is multiplied by: alpha / r, or alpha / sqrt(r) with rank-stabilized LoRA."""
        return self.lora_alpha / (math.sqrt(self.rank) if self.use_rslora else self.rank)


def read_adapter_config(path: str, max_lora_rank: int) -> PEFTAdapterConfig:
    """The adapter's config, or ValueError naming what is wrong: a missing directory or file,
    malformed JSON, a method other than plain LoRA, a rank above `max_lora_rank`."""
    if not os.path.isdir(path):
        raise ValueError(f"LoRA adapter directory {path!r} does not exist")
    config_path = os.path.join(path, CONFIG_FILE)
    if not os.path.isfile(config_path):
        raise ValueError(f"LoRA adapter {path!r} has no {CONFIG_FILE}")
    if not os.path.isfile(os.path.join(path, WEIGHTS_FILE)):
        raise ValueError(f"LoRA adapter {path!r} has no {WEIGHTS_FILE}")
    try:
        with open(config_path, encoding="utf-8") as f:
            raw = json.load(f)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"LoRA adapter {path!r}: {CONFIG_FILE} is not valid JSON ({e})") from e
    if not isinstance(raw, dict):
        raise ValueError(f"LoRA adapter {path!r}: {CONFIG_FILE} must hold a JSON object")
    peft_type = raw.get("peft_type", "LORA")
    if peft_type != "LORA":
        raise ValueError(f"LoRA adapter {path!r}: peft_type {peft_type!r} is not supported (only LORA)")
    rank, alpha = raw.get("r"), raw.get("lora_alpha", raw.get("r"))
    if not isinstance(rank, int) or isinstance(rank, bool) or rank < 1:
        raise ValueError(f"LoRA adapter {path!r}: r must be a positive integer, got {rank!r}")
    if rank > max_lora_rank:
        raise ValueError(f"LoRA adapter {path!r} has rank {rank}, above max_lora_rank={max_lora_rank}")
    if not isinstance(alpha, (int, float)) or isinstance(alpha, bool):
        raise ValueError(f"LoRA adapter {path!r}: lora_alpha must be a number, got {alpha!r}")
    if raw.get("bias", "none") != "none":
        raise ValueError(f"LoRA adapter {path!r}: bias {raw.get('bias')!r} is not supported (only 'none')")
    for unsupported in ("use_dora", "modules_to_save", "rank_pattern", "alpha_pattern", "layer_replication"):
        if raw.get(unsupported):
            raise ValueError(f"LoRA adapter {path!r}: {unsupported} is not supported")
    targets = raw.get("target_modules")
    if isinstance(targets, list) and targets and all(isinstance(t, str) for t in targets):
        target_modules: tuple[str, ...] | str = tuple(targets)
    elif isinstance(targets, str) and targets:
        try:
            re.compile(targets)
        except re.error as e:
            raise ValueError(f"LoRA adapter {path!r}: target_modules {targets!r} is not a valid regex ({e})") from e
        target_modules = targets
    else:
        raise ValueError(f"LoRA adapter {path!r}: target_modules must be a list of module names or a regex, "
                         f"got {targets!r}")
    return PEFTAdapterConfig(rank, float(alpha), target_modules, bool(raw.get("use_rslora", False)))
