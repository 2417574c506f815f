"""A PEFT adapter's weights mapped onto the model's linears.

PEFT names each adapted module as the checkpoint does (`model.layers.0.self_attn.q_proj`); kvtide
fuses some of them (q, k, v -> qkv_proj; gate, up -> gate_up_proj), as the model's
`packed_modules_mapping` declares. Each checkpoint module is a `LoRATarget`: the kvtide linear it
lives in, and which shard (output rows) of it. An adapter loads into host memory as, per kvtide
linear, per shard, A (r, in) and B (out_rows, r) with the scaling folded into B.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field

import torch
from torch import nn

from kvtide.layers.linear import LinearBase
from kvtide.lora.peft_config import WEIGHTS_FILE, read_adapter_config
from kvtide.lora.request import LoRARequest

_PEFT_KEY = re.compile(r"^(?:base_model\.model\.)?(?P<module>.+)\.lora_(?P<which>[AB])(?:\.[^.]+)?\.weight$")


@dataclass(frozen=True)
class LoRATarget:
    """One checkpoint module LoRA may adapt: shard `shard_index` of kvtide linear `linear_name`,
    output rows [offset, offset + size) of it."""

    linear_name: str
    shard_index: int
    offset: int
    size: int
    in_features: int


@dataclass
class TargetLinear:
    """A kvtide linear that adapters may adapt, and its shards' output rows."""

    name: str
    module: nn.Module
    out_slices: list[tuple[int, int]]


def find_lora_targets(model: nn.Module) -> tuple[dict[str, LoRATarget], dict[str, TargetLinear]]:
    """(checkpoint module name (no "model.") -> LoRATarget, kvtide linear name -> TargetLinear)
    for every plain or fused linear of the model (the LM head and embeddings are not linears here)."""
    packed = getattr(model, "packed_modules_mapping", {})
    unpacked = {(fused, shard): name for name, (fused, shard) in packed.items()}
    targets: dict[str, LoRATarget] = {}
    linears: dict[str, TargetLinear] = {}
    for name, module in model.named_modules():
        if not isinstance(module, LinearBase):
            continue
        prefix, _, leaf = name.rpartition(".")
        slices = []
        for index, shard_id in enumerate(module.shard_ids):
            offset, size = module.shard_range(shard_id)
            slices.append((offset, size))
            ckpt_leaf = unpacked.get((leaf, shard_id), leaf) if shard_id is not None else leaf
            ckpt_name = f"{prefix}.{ckpt_leaf}" if prefix else ckpt_leaf
            targets[ckpt_name] = LoRATarget(name, index, offset, size, module.input_size)
        linears[name] = TargetLinear(name, module, slices)
    return targets, linears


@dataclass
class LoadedAdapter:
    """An adapter in host memory: per kvtide linear, per shard index, (A (r, in), B * scaling (rows, r))."""

    request: LoRARequest
    rank: int
    weights: dict[str, dict[int, tuple[torch.Tensor, torch.Tensor]]] = field(default_factory=dict)


def load_adapter(request: LoRARequest, targets: dict[str, LoRATarget], max_lora_rank: int,
                 dtype: torch.dtype, checkpoint_name=lambda name: name) -> LoadedAdapter:
    """Read and check an adapter against the model; ValueError before anything is kept: files
    missing or malformed, a rank above `max_lora_rank`, target modules the model lacks, tensors of
    the wrong shape. `checkpoint_name`: the model's renaming of checkpoint names (no "model.")."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    path = request.lora_path
    config = read_adapter_config(path, max_lora_rank)
    if isinstance(config.target_modules, tuple):
        leaves = {name.rsplit(".", 1)[-1] for name in targets}
        lacking = [t for t in config.target_modules if t.rsplit(".", 1)[-1] not in leaves]
        if lacking:
            raise ValueError(f"LoRA adapter {request.lora_name!r} targets modules the model lacks: "
                             f"{', '.join(sorted(lacking))} (adaptable here: {', '.join(sorted(leaves))}; "
                             "embeddings and the LM head are not)")
    try:
        tensors = load_file(os.path.join(path, WEIGHTS_FILE))
    except (SafetensorError, OSError, ValueError) as e:
        raise ValueError(f"LoRA adapter {request.lora_name!r}: cannot read {WEIGHTS_FILE} ({e})") from e
    pairs: dict[str, dict[str, torch.Tensor]] = {}
    for key, tensor in tensors.items():
        match = _PEFT_KEY.match(key)
        if match is None:
            raise ValueError(f"LoRA adapter {request.lora_name!r}: unexpected tensor {key!r} (only lora_A and "
                             "lora_B weights are supported)")
        module = checkpoint_name(match["module"].removeprefix("model."))
        if module not in targets:
            raise ValueError(f"LoRA adapter {request.lora_name!r}: tensor {key!r} names a module the model lacks")
        pairs.setdefault(module, {})[match["which"]] = tensor
    if not pairs:
        raise ValueError(f"LoRA adapter {request.lora_name!r}: {WEIGHTS_FILE} holds no LoRA weights")
    adapter = LoadedAdapter(request, config.rank)
    for module, pair in sorted(pairs.items()):
        if set(pair) != {"A", "B"}:
            raise ValueError(f"LoRA adapter {request.lora_name!r}: {module} has lora_{''.join(pair)} without its pair")
        target = targets[module]
        a, b = pair["A"], pair["B"]
        if tuple(a.shape) != (config.rank, target.in_features) or tuple(b.shape) != (target.size, config.rank):
            raise ValueError(f"LoRA adapter {request.lora_name!r}: {module} has lora_A {tuple(a.shape)} and lora_B "
                             f"{tuple(b.shape)}; the model needs ({config.rank}, {target.in_features}) and "
                             f"({target.size}, {config.rank})")
        if not (torch.isfinite(a).all() and torch.isfinite(b).all()):
            raise ValueError(f"LoRA adapter {request.lora_name!r}: {module} holds non-finite weights")
        scaled_b = (b.double() * config.scaling).to(dtype)
        adapter.weights.setdefault(target.linear_name, {})[target.shard_index] = (a.to(dtype).contiguous(), scaled_b)
    return adapter
